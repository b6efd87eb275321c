"""A watchdog that stops the temporary Prefect server when the `rlops` process that started it dies.

The driver stops its temporary server from an `atexit` hook (flows/temp_server.py), which never runs
when the driver is killed with SIGKILL alone (the kernel's OOM killer does exactly that, to one
process, not its group): the server would live on, holding its port and SQLite database. A
parent-death signal (`prctl(PR_SET_PDEATHSIG)`) would need a `preexec_fn`, unsafe in a driver with
threads; instead each server process gets a small watchdog process, started by the driver right
after the server's `Popen` (before its ~10-20 s start-up, so a kill during start-up is covered too).

The watchdog polls its own parent: when `os.getppid()` is no longer the driver, the driver has
died and the watchdog terminates the server (SIGTERM, then SIGKILL after a grace period). It
exits on its own as soon as the server has exited (the normal `atexit` stop). It holds the
server as a `psutil.Process`, which refuses to signal a pid the kernel has since reused.

    python -m flows.server_watchdog DRIVER_PID SERVER_PID
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

POLL_S = 0.5  # how soon a dead driver is noticed; a sleeping poll costs nothing measurable
GRACE_S = 10.0  # uvicorn's graceful shutdown (Prefect's services stop) before SIGKILL


def start_watchdog(server_pid: int) -> subprocess.Popen[bytes]:
    """Start the watchdog process for `server_pid`, owned by (a child of) this process."""
    return subprocess.Popen([sys.executable, "-m", "flows.server_watchdog", str(os.getpid()), str(server_pid)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True)


def run(driver_pid: int, server_pid: int) -> int:
    """The watchdog loop; returns the exit status (0: nothing left to watch)."""
    import psutil

    # Ctrl-C in a terminal reaches the whole process group: the driver handles it and stops the
    # server itself; the watchdog must outlive that to still cover a later SIGKILL of the driver.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        server = psutil.Process(server_pid)
        # A zombie has exited and waits for the driver to reap it: nothing left to stop.
        while server.is_running() and server.status() != psutil.STATUS_ZOMBIE:
            if os.getppid() != driver_pid:  # re-parented: the driver is gone
                stop(server)
                return 0
            time.sleep(POLL_S)
    except psutil.NoSuchProcess:  # the server exited between two checks
        pass
    return 0


def stop(server: Any) -> None:
    """SIGTERM `server` (a psutil.Process), then SIGKILL if it has not exited after GRACE_S."""
    import psutil

    try:
        server.terminate()
        try:
            server.wait(timeout=GRACE_S)
        except psutil.TimeoutExpired:
            server.kill()
    except psutil.NoSuchProcess:  # it exited on its own meanwhile
        pass


if __name__ == "__main__":
    sys.exit(run(int(sys.argv[1]), int(sys.argv[2])))
