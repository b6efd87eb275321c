"""Run untrusted Python programs against tests: `Sandbox` (one template process), `SandboxPool` (several, thread-safe).

    pool = SandboxPool(2)
    result = pool.run("def add(a, b):\\n    return a + b", asserts=["assert add(1, 2) == 3"])
    result.outcome, result.passed, result.tests     # "pass", 1.0, [{"outcome": "pass"}]

A `Result`'s `outcome` is one of pass, fail (a test failed or did not run), error (the program does not load),
timeout, memory, crash, killed, output (past the output limit); each test has its own outcome and error. A
template is a `python` process started once (sandbox/server.py) that forks one execution per request, so an
execution costs forks, not a fresh interpreter (bench/bench_sandbox.py).

The isolation needs root (or CAP_SYS_ADMIN): network, mount and PID namespaces and a distinct uid. Without it
`SandboxUnavailable` says so before anything runs; nothing is ever run unisolated.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import pwd
import queue
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)
FIRST_UID = 61_000  # executions run as uids from here (one per template): no files, no processes of anyone else


class SandboxUnavailable(RuntimeError):
    """The machine cannot isolate an execution (not root, no namespaces): nothing is run."""


@dataclass(frozen=True)
class Limits:
    """Per execution. Defaults fit a short test-backed function: seconds, not minutes; tens of MB, not GB."""

    wall_seconds: float = 10.0  # the whole execution (the program and every test), killed at this
    test_seconds: float = 5.0  # each test
    cpu_seconds: int = 10  # per process (RLIMIT_CPU)
    memory_mb: int = 512  # address space per process (RLIMIT_AS): a memory bomb gets MemoryError
    processes: int = 16  # of the execution's uid (RLIMIT_NPROC): a fork bomb stops here
    open_files: int = 64  # RLIMIT_NOFILE
    file_size_mb: int = 16  # any one file it writes, stdout and stderr included (RLIMIT_FSIZE)
    output_chars: int = 65_536  # what the `io` and `run` kinds keep of the program's output


@dataclass
class Result:
    outcome: str  # pass, fail, error, timeout, memory, crash, killed, output
    tests: list[dict[str, Any]] = field(default_factory=list)  # per test: outcome (pass, fail, error, exit, ...), error
    stdout: str = ""
    stderr: str = ""
    error: str | None = None
    seconds: float = 0.0

    @property
    def passed(self) -> float:
        """The fraction of tests that passed (0.0 without tests)."""
        return sum(t["outcome"] == "pass" for t in self.tests) / len(self.tests) if self.tests else 0.0


def tests_of(*, asserts: list[str] | None = None, check: str | None = None, entry_point: str | None = None,
             cases: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """The request's `tests` (sandbox/harness.py): asserts, a HumanEval check with its entry point, stdin/stdout
    cases, or none (run the program once)."""
    if check is not None:
        if not entry_point:
            raise ValueError("a check(candidate) test needs the entry point's name")
        return {"kind": "check", "check": check, "entry_point": entry_point}
    if asserts is not None:
        return {"kind": "asserts", "asserts": list(asserts)}
    if cases is not None:
        return {"kind": "io", "cases": [{"stdin": str(c.get("stdin", "")), "stdout": str(c["stdout"])} for c in cases]}
    return {"kind": "run"}


def default_hidden(extra: Iterable[str | os.PathLike[str]] = ()) -> list[str]:
    """What executions never see: the home folder ($HOME and the account's own), the current folder (a repository,
    a workspace), the temp folders, the other world-writable places, and `extra`."""
    return [str(Path.home()), pwd.getpwuid(os.getuid()).pw_dir, os.getcwd(), tempfile.gettempdir(), "/tmp",
            "/var/tmp", "/dev/shm", "/run", "/work", "/srv", "/mnt", "/media", "/opt", *map(str, extra)]


def closed_ancestors(paths: Iterable[str]) -> list[str]:
    """The folders above `paths` that other uids cannot pass through (a 0700 home holding Python's standard
    library): covered too, so that the kept paths, put back inside the cover, are reachable by the program's uid."""
    out = []
    for path in paths:
        for parent in Path(path).parents:
            if str(parent) != "/" and not parent.stat().st_mode & 0o001:
                out.append(str(parent))
    return out


class Sandbox:
    """One template process; `run` one execution at a time (use SandboxPool from threads)."""

    def __init__(self, hidden: Iterable[str] | None = None, tmp_mb: int = 256, slot: int = 0) -> None:
        if os.geteuid() != 0:
            raise SandboxUnavailable("the code sandbox needs root (or CAP_SYS_ADMIN) for its network, mount and "
                                     "PID namespaces and a uid of its own; run the scoring stage as root")
        self.uid = FIRST_UID + (os.getpid() % 500) * 8 + slot % 8  # distinct per template of a process
        keep = sorted({str(Path(os.__file__).parent), _dynload()})  # the standard library, not a venv's packages
        hide = list(hidden if hidden is not None else default_hidden()) + closed_ancestors(keep)
        config = {"hide": hide, "keep": keep, "tmp_mb": tmp_mb, "uid": self.uid}
        code = f"import sys; sys.path.insert(0, {PACKAGE_PARENT!r}); from sandbox.server import main; main()"
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", code, json.dumps(config)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/",
                                     env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read()[-2000:]
            self.proc.wait()
            raise SandboxUnavailable(f"the sandbox's template did not start: {err.strip() or 'no message'}")
        self.lock = threading.Lock()

    def run(self, program: str, limits: Limits = Limits(), **tests: Any) -> Result:
        """Run `program` against the tests (`tests_of`'s keywords) in a fresh execution."""
        request = {"program": program, "tests": tests_of(**tests), "limits": asdict(limits)}
        with self.lock:
            if self.proc.poll() is not None:
                raise SandboxUnavailable(f"the sandbox's template has exited ({self.proc.returncode})")
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise SandboxUnavailable(f"the sandbox's template died: {self.proc.stderr.read()[-2000:]}")
        out = json.loads(line)
        return Result(outcome=out["outcome"], tests=out.get("tests", []), stdout=out.get("stdout", ""),
                      stderr=out.get("stderr", ""), error=out.get("error"), seconds=out.get("seconds", 0.0))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class SandboxPool:
    """`size` templates shared by threads: `run` takes a free one; `map` runs many jobs `size` at a time."""

    def __init__(self, size: int = 2, hidden: Iterable[str] | None = None) -> None:
        self.sandboxes = [Sandbox(hidden, slot=i) for i in range(size)]
        self.free: queue.Queue[Sandbox] = queue.Queue()
        for s in self.sandboxes:
            self.free.put(s)

    def run(self, program: str, limits: Limits = Limits(), **tests: Any) -> Result:
        sandbox = self.free.get()
        try:
            return sandbox.run(program, limits, **tests)
        finally:
            self.free.put(sandbox)

    def map(self, jobs: list[dict[str, Any]], limits: Limits = Limits()) -> list[Result]:
        """Each job is `run`'s keywords (`program` and the tests); results in order."""
        with ThreadPoolExecutor(len(self.sandboxes)) as threads:
            return list(threads.map(lambda job: self.run(limits=limits, **job), jobs))

    def close(self) -> None:
        for s in self.sandboxes:
            s.close()


@functools.lru_cache(maxsize=1)
def shared_pool() -> SandboxPool:
    """This process's pool (made on first use, one template per CPU), closed at exit. Cached, not a module global:
    a reward's version walks the code it reaches (rewards/reach.py), and must not see the pool come and go."""
    pool = SandboxPool(os.cpu_count() or 2)
    atexit.register(pool.close)
    return pool


def _dynload() -> str:
    import _ctypes  # a compiled module: its folder is lib-dynload, which the standard library's imports need

    return str(Path(_ctypes.__file__).parent)
