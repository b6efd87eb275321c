"""The sandbox's template process: isolated once at start, then one forked execution per request.

Started by `sandbox.pool.Sandbox` (never by hand): requests arrive as JSON lines on stdin, results leave as JSON
lines on stdout. At start, as root, it enters a network namespace with no interface up (not even loopback: the
run's services listen there) and a mount namespace where the given folders (the repository, the workspace, the
home folder, /tmp and the other world-writable places) are covered by empty tmpfs, Python's standard library
put back read-only; then it imports what programs commonly use, so a fork starts warm.

Each execution: the template forks a supervisor (A) that enforces the wall time; A makes a PID namespace and
forks its init (B, root), which mounts a /proc of that namespace only and forks the program's process (C): a
fresh folder as cwd and HOME, stdin from /dev/null, stdout and stderr to files there, limits on CPU, memory,
processes, open files and file size, a uid of its own, no way back to root. When B ends, the kernel kills every
process left in the namespace: nothing outlives its execution. The folder is removed after.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import sys
import time
from typing import Any

from sandbox import harness, isolate

ROOT = "/run/rlops-sandbox"  # in the template's own /run (a tmpfs only root writes to): executions' folders
SCRATCH = ("/tmp", "/var/tmp", "/dev/shm")  # world-writable: a fresh tmpfs in each execution, gone with it
WARM = ("math", "re", "collections", "itertools", "functools", "heapq", "bisect", "string", "typing", "json",
        "random", "fractions", "decimal", "statistics", "datetime", "hashlib", "operator", "copy", "dataclasses",
        "ctypes", "unicodedata", "textwrap", "enum", "array")
STREAM_CHARS = 16_384  # of each of stdout and stderr kept in a result


class _Timeout(Exception):
    pass


def main() -> None:
    config = json.loads(sys.argv[1])
    isolate.unshare(isolate.CLONE_NEWNS | isolate.CLONE_NEWNET)
    isolate.hide(config["hide"], config["keep"], config["tmp_mb"])
    os.makedirs(ROOT, mode=0o711)
    os.chdir("/")
    for name in WARM:
        __import__(name)
    uid, count = config["uid"], 0
    out = sys.stdout
    out.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    out.flush()
    for line in sys.stdin:
        count += 1
        try:
            result = execute(json.loads(line), uid, f"{ROOT}/{count}")
        except Exception as e:  # noqa: BLE001 - the template survives a request it cannot run
            result = {"outcome": "error", "error": f"sandbox: {type(e).__name__}: {e}", "tests": []}
        out.write(json.dumps(result) + "\n")
        out.flush()


def execute(request: dict[str, Any], uid: int, folder: str) -> dict[str, Any]:
    """Run one request in a fresh execution; its result (see sandbox.pool.Result)."""
    limits = request["limits"]
    nonce = secrets.token_hex(16)
    os.mkdir(folder, 0o700)
    os.chown(folder, uid, uid)
    r, w = os.pipe()
    t0 = time.monotonic()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _supervise(request, folder, w, nonce, uid)
    os.close(w)
    records, data = [], b""
    with os.fdopen(r, "rb") as pipe:  # EOF once every process of the execution has ended
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    prefix = nonce + " "
    for line in data.decode(errors="replace").splitlines():
        if line.startswith(prefix):
            try:
                records.append(json.loads(line[len(prefix):]))
            except ValueError:
                continue
    streams = {name: _head(os.path.join(folder, name)) for name in ("stdout", "stderr")}
    shutil.rmtree(folder, ignore_errors=True)
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 255
    return summarize(request, records, code, streams, time.monotonic() - t0, limits)


def _supervise(request: dict[str, Any], folder: str, w: int, nonce: str, uid: int) -> None:
    """A: start the execution's PID namespace and its init, and kill it at the wall time. Exits 0 when the
    program's process finished, 124 at the wall time, 125 when the namespace could not be made, else B's code."""
    code = 125
    try:
        isolate.unshare(isolate.CLONE_NEWPID)
        pid = os.fork()
        if pid == 0:
            _init(request, folder, w, nonce, uid)
        os.close(w)

        def alarm(*_: Any) -> None:
            raise _Timeout

        signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, request["limits"]["wall_seconds"])
        try:
            _, status = os.waitpid(pid, 0)
            signal.setitimer(signal.ITIMER_REAL, 0)
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 126
        except _Timeout:
            os.kill(pid, signal.SIGKILL)  # the namespace's init: every process in it dies with it
            os.waitpid(pid, 0)
            code = 124
    finally:
        os._exit(code)


def _init(request: dict[str, Any], folder: str, w: int, nonce: str, uid: int) -> None:
    """B, PID 1 of the execution's namespace (root): its own mounts and /proc, stdio, then the program's process.
    Exits with C's exit code, or 128 + the signal that killed it."""
    code = 127
    try:
        isolate.unshare(isolate.CLONE_NEWNS)
        isolate.mount(None, "/", None, isolate.MS_REC | isolate.MS_PRIVATE)
        isolate.mount("proc", "/proc", "proc", isolate.MS_NOSUID | isolate.MS_NODEV | isolate.MS_NOEXEC)
        isolate.mount("sysfs", "/sys", "sysfs", isolate.MS_RDONLY | isolate.MS_NOSUID | isolate.MS_NODEV | isolate.MS_NOEXEC)
        for path in SCRATCH:  # nothing one execution writes there is seen by the next
            isolate.mount("tmpfs", path, "tmpfs", isolate.MS_NOSUID | isolate.MS_NODEV,
                          f"mode=1777,size={request['limits']['file_size_mb']}m")
        os.chdir(folder)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            f = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.fchown(f, uid, uid)
            os.dup2(f, fd)
            os.close(f)
        os.close(null)
        pid = os.fork()
        if pid == 0:
            _program(request, folder, w, nonce, uid)
        os.close(w)
        _, status = os.waitpid(pid, 0)
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
    finally:
        os._exit(code)


def _program(request: dict[str, Any], folder: str, w: int, nonce: str, uid: int) -> None:
    """C: the limits, the uid, a clean environment and file table; then the harness."""
    limits = request["limits"]
    try:
        isolate.set_limits(cpu_seconds=limits["cpu_seconds"], memory_mb=limits["memory_mb"],
                           processes=limits["processes"], open_files=limits["open_files"],
                           file_size_mb=limits["file_size_mb"])
        isolate.become(uid)
        os.environ.clear()
        os.environ.update(HOME=folder, TMPDIR=folder, PATH="/usr/local/bin:/usr/bin:/bin", LANG="C.UTF-8")
        os.closerange(3, w)
        os.closerange(w + 1, 4096)
        prefix = (nonce + " ").encode()
        write, dumps = os.write, json.dumps  # bound before the program runs: it may replace the modules' names

        def report(record: dict[str, Any]) -> None:
            write(w, prefix + dumps(record, default=str).encode() + b"\n")

        harness.run(request, report)
    except BaseException:  # noqa: BLE001 - whatever escaped the harness: the process's end says enough
        pass
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def summarize(request: dict[str, Any], records: list[dict[str, Any]], code: int, streams: dict[str, str],
              seconds: float, limits: dict[str, Any]) -> dict[str, Any]:
    """One result from the records the execution reported and how its processes ended."""
    tests_kind = request["tests"]["kind"]
    n = {"asserts": len(request["tests"].get("asserts", [])), "check": 1,
         "io": len(request["tests"].get("cases", [])), "run": 0}[tests_kind]
    by_test = {r["test"]: {k: v for k, v in r.items() if k != "test"} for r in records if "test" in r}
    load = next((r for r in records if "load" in r), None)
    run = next((r["run"] for r in records if "run" in r), None)
    ended = _ended(code, limits)
    early = f"the program ended its process (exit code {code}) before the tests ran" if code < 124 else "the execution ended first"
    tests = []
    for i in range(n):
        if i in by_test:
            tests.append(by_test[i])
        elif load is not None and load["load"] != "ok":
            tests.append({"outcome": "not_run", "error": load.get("error")})
        else:
            tests.append({"outcome": "not_run", "error": ended["error"] if ended else early})
    result: dict[str, Any] = {"tests": tests, "seconds": round(seconds, 4), **streams}
    if run is not None:
        result["stdout"] = run["stdout"]
        result["error"] = run["error"]
    if ended is not None:  # the execution itself did not finish: its outcome says how it ended
        result.update(outcome=ended["outcome"], error=ended["error"])
    elif tests_kind == "run":
        result["outcome"] = "pass" if run is not None and run["error"] is None else "fail"
        if run is None:
            result["error"] = "the program ended the process"
    elif load is not None and load["load"] != "ok":  # memory, output (limits hit while loading), exit, error
        result.update(outcome=load["load"] if load["load"] in ("memory", "output") else "error", error=load["error"])
    else:
        result["outcome"] = "pass" if tests and all(t["outcome"] == "pass" for t in tests) else "fail"
        if load is None:
            result["error"] = early
    return result


def _ended(code: int, limits: dict[str, Any]) -> dict[str, Any] | None:
    """How the execution ended when it did not finish normally (None when it did)."""
    if code < 124:  # 0: the program's process finished; 1..123: the program ended it itself (sys.exit, os._exit)
        return None
    if code == 124:
        return {"outcome": "timeout", "error": f"over the wall time ({limits['wall_seconds']:g} s)"}
    if code in (125, 127):
        return {"outcome": "error", "error": "the sandbox could not start the execution"}
    if code > 128:
        status = code - 128  # a signal number, as a wait status of a killed process
        return harness.status_outcome(status, "the program")
    return {"outcome": "killed", "error": f"the execution ended with code {code}"}


def _head(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(STREAM_CHARS).decode(errors="replace")
    except OSError:
        return ""


if __name__ == "__main__":
    main()
