"""Processes the tests start: free ports, servers waited for until they answer, stopping them, and
killing a run mid-way (the kill-and-rerun tests).

    port = free_port()
    proc = start_server([sys.executable, "server.py", "--port", str(port)], f"http://127.0.0.1:{port}/health",
                        status=200)
    stop(proc)                                           # SIGTERM to its process group, SIGKILL if it lingers

    wait_until(lambda: marker.exists(), proc, "the stage started training")
    kill(proc, group=False)                              # SIGKILL, as the OOM killer does; then rerun and compare

Servers start in a session of their own (so stopping the group stops their children) and get SIGTERM
when the test process dies (tests.netguard.die_with_parent): a killed test run leaves none behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, TypeVar

from tests.netguard import die_with_parent

T = TypeVar("T")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(argv: list[str], url: str, *, timeout: float = 120.0, status: int | None = None,
                 env: dict[str, str] | None = None, cwd: Path | None = None, every: float = 0.2) -> subprocess.Popen:
    """Start `argv` (its own session; stdout discarded, stderr kept in a temporary file for the error)
    and wait until GET `url` answers (with `status`, when given); raise RuntimeError if it exits or
    `timeout` passes first."""
    import httpx

    errors = tempfile.TemporaryFile()  # not a pipe: a chatty server would block on a full one
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=errors, env=env, cwd=cwd,
                            start_new_session=True, preexec_fn=die_with_parent)
    deadline = time.monotonic() + timeout
    while True:
        try:
            answer = httpx.get(url, timeout=2)
            if status is None or answer.status_code == status:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            kill(proc, group=True)
            errors.seek(0)
            raise RuntimeError(f"{argv[:4]} did not answer at {url}: {errors.read().decode(errors='replace')[-2000:]}")
        time.sleep(every)


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM to `proc`'s process group (a server and its children), SIGKILL after `timeout` s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(proc, group=True)


def kill(proc: subprocess.Popen, *, group: bool) -> None:
    """SIGKILL `proc` and wait for it: its process group when `group` (a process started in a session
    of its own, with the servers it started), else `proc` alone (as the OOM killer does)."""
    if not group:
        proc.send_signal(signal.SIGKILL)
    else:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the whole group has exited already
            pass
    proc.wait()


def start_run(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `argv` (an `rlops` run to be killed mid-way) in a session of its own, so killing its group
    kills the servers it started too; its stdout and stderr go to `log`, which `wait_until(..., log=log)`
    quotes if it exits before it could be killed."""
    with open(log, "wb") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent)


def wait_until(ready: Callable[[], T], proc: subprocess.Popen, what: str, timeout: float = 300.0,
               every: float = 0.05, log: Path | None = None) -> T:
    """Poll `ready()` until it is truthy and return it; fail if `proc` exits first (it ended before
    `what`: a kill-and-rerun test would kill nothing; the end of its `log` is quoted) or after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not (found := ready()):
        if proc.poll() is not None:
            tail = log.read_bytes()[-3000:].decode(errors="replace") if log and log.exists() else "(no log)"
            raise AssertionError(f"the process exited ({proc.returncode}) before {what}:\n{tail}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)
    return found
