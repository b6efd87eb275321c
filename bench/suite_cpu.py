"""Where the suite's CPU goes: every process's CPU time, by test and by kind of process.

    PYTHONPATH=bench python3 bench/suite_cpu.py --out /tmp/suite-cpu -- make test TESTS="-p suite_cpu"

The suite is CPU-bound on 2 cores (docs/BENCHMARKS.md), so a test's wall time under four workers says little
about what it costs; its CPU does. Two sources, joined in the report:
- this script samples /proc every 0.2 s while the command runs: each process's user + system time (its last
  sample), its command line, and the test that was running where it was started (`PYTEST_CURRENT_TEST` in its
  initial environment: a test's subprocesses, servers and clusters inherit it; a Ray worker inherits the
  environment its raylet had, so its CPU goes to the test that started that Ray);
- loaded into pytest (`-p suite_cpu`, this module), each test's own process CPU (`getrusage`, every thread) is
  written to `<out>/tests.jsonl` (the path comes in SUITE_CPU_OUT, which this script sets).
A process that lives less than one sample interval is missed (cheap ones, by construction). Written:
`<out>/processes.json` and the report on stdout (CPU by kind of process, by test file, the costliest tests).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
KINDS = [  # (kind, pattern on the command line): the first that matches
    ("rlops CLI", r"flows\.cli|bin/rlops"), ("Prefect server", r"prefect.server.api.server|prefect server start"),
    ("Ray worker", r"^ray::|default_worker\.py"), ("Ray daemons", r"raylet|gcs_server|ray start|dashboard|runtime_env"),
    ("pytest", r"pytest|execnet|xdist|sys\.stdin\.readline"),  # an xdist worker is execnet's `python -c ...`
    ("chromium", r"chrom"), ("vLLM", r"vllm"), ("moto", r"moto"),
    ("node", r"^node|/node "), ("uvicorn", r"uvicorn"), ("mlflow", r"mlflow"), ("other python", r"python"),
]


def _read(pid: str) -> tuple[float, str, str] | None:
    """(CPU seconds, command line, the test it was started under) of one process; None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()
        cpu = (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (OSError, ValueError, IndexError):
        return None
    test = next((e.split(b"=", 1)[1].decode(errors="replace") for e in env if e.startswith(b"PYTEST_CURRENT_TEST=")), "")
    return cpu, cmd or stat[stat.index("(") + 1:stat.rindex(")")], test.rsplit(" ", 1)[0]


def sample(stop: threading.Event, seen: dict[str, dict], every: float = 0.2) -> None:
    """Until `stop`: each process's latest CPU time (its command line and test read once, when first seen)."""
    me = str(os.getpid())
    while not stop.is_set():
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or pid == me:
                continue
            if pid in seen:
                try:
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                    seen[pid]["cpu"] = (int(fields[11]) + int(fields[12])) / TICK
                except (OSError, IndexError, ValueError):
                    pass
            elif (got := _read(pid)) is not None:
                seen[pid] = {"cpu": got[0], "cmd": got[1][:300], "test": got[2], "first": time.time()}
        stop.wait(every)


def kind(cmd: str) -> str:
    return next((k for k, pattern in KINDS if re.search(pattern, cmd)), "other")


def report(seen: dict[str, dict], tests: list[dict], before: set[str]) -> None:
    procs = [p for pid, p in seen.items() if pid not in before]
    by_kind = collections.Counter()
    for p in procs:
        by_kind[kind(p["cmd"])] += p["cpu"]
    print(f"CPU of the processes started meanwhile: {sum(by_kind.values()):.0f} s")
    for k, cpu in by_kind.most_common():
        print(f"  {cpu:8.1f} s  {k} ({sum(1 for p in procs if kind(p['cmd']) == k)} processes)")
    per_test = collections.Counter()  # subprocesses by the test that started them, pytest's own processes excluded
    for p in procs:
        if p["test"] and kind(p["cmd"]) != "pytest":
            per_test[p["test"]] += p["cpu"]
    own = collections.Counter({t["test"]: t["self_cpu"] for t in tests})
    total = own + per_test
    files = collections.Counter()
    for test, cpu in total.items():
        files[test.split("::")[0]] += cpu
    print(f"\nBy test file (the test's own process + what it started): {sum(files.values()):.0f} s")
    for f, cpu in files.most_common(30):
        print(f"  {cpu:8.1f} s  {f}")
    print("\nThe costliest tests (own + started):")
    for t, cpu in total.most_common(30):
        print(f"  {cpu:8.1f} s  ({own[t]:6.1f} own)  {t}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/suite-cpu")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tests.jsonl").unlink(missing_ok=True)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    before = {p for p in os.listdir("/proc") if p.isdigit()}
    seen: dict[str, dict] = {}
    stop = threading.Event()
    thread = threading.Thread(target=sample, args=(stop, seen), daemon=True)
    thread.start()
    code = subprocess.run(command, env={**os.environ, "SUITE_CPU_OUT": str(out / "tests.jsonl")}).returncode
    stop.set()
    thread.join()
    (out / "processes.json").write_text(json.dumps(seen))
    lines = (out / "tests.jsonl").read_text().splitlines() if (out / "tests.jsonl").exists() else []
    report(seen, [json.loads(line) for line in lines], before)
    sys.exit(code)


# -- the pytest plugin (`-p suite_cpu`) --------------------------------------------------------------------------

def _runtest_protocol(item, nextitem):  # noqa: ARG001 - pytest's hook signature
    """Around each test (setup, call, teardown): this process's CPU time, appended to SUITE_CPU_OUT."""
    import resource

    path = os.environ.get("SUITE_CPU_OUT")
    begin = resource.getrusage(resource.RUSAGE_SELF)
    wall = time.perf_counter()
    yield
    if path:
        end = resource.getrusage(resource.RUSAGE_SELF)
        row = {"test": item.nodeid, "self_cpu": end.ru_utime - begin.ru_utime + end.ru_stime - begin.ru_stime,
               "wall": time.perf_counter() - wall, "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


try:  # loaded as a plugin; run as a script it may be a Python without pytest
    import pytest

    pytest_runtest_protocol = pytest.hookimpl(hookwrapper=True)(_runtest_protocol)
except ImportError:
    pass

if __name__ == "__main__":
    main()
