"""The temporary Prefect server of `rlops run` (and `rescore`, `retrain`, `stage --prefect`), started by rlops.

With no `PREFECT_API_URL`, Prefect starts a temporary server itself on its first API call
(`prefect.server.api.server.SubprocessASGIServer`). Reaching that class imports Prefect's whole server
(its ORM, API routes and services) into the driver, which never serves a request: ~2 s of CPU per
command on 2 cores, measured. rlops starts the same server the same way instead (the same uvicorn
command, environment and start-up timeout; a free port from the OS) and hands the flow its address, so the driver
imports only Prefect's client. The server also gets what rlops adds to it: a watchdog that stops it if
the driver is SIGKILLed (flows/server_watchdog.py) and a lower CPU priority (`RLOPS_PREFECT_SERVER_NICE`).
It stops when the driver exits, as Prefect's does.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

PORT_IN_USE = 3  # uvicorn's exit status when its port was taken meanwhile
STOP_GRACE_S = 5.0  # as Prefect's stop: SIGTERM, then SIGKILL


class TemporaryServer:
    """A Prefect server on 127.0.0.1 in a child process, on the Prefect settings of this process."""

    def __init__(self, niceness: int = 0) -> None:
        self.niceness = niceness
        self.port: int | None = None
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def start(self, timeout_s: float, meanwhile: Callable[[], object] | None = None) -> str:
        """Start the server and wait until it answers its health check; returns its API URL. `meanwhile`, if
        given, runs after the spawn and before the wait: the driver's own start-up beside the server's boot (its
        ~5 s on 2 cores were a wait before any of the run's work)."""
        import httpx

        self._spawn()
        atexit.register(self.stop)
        if meanwhile is not None:
            meanwhile()
        deadline = time.monotonic() + timeout_s
        with httpx.Client() as client:
            while time.monotonic() < deadline:
                assert self.process is not None
                code = self.process.poll()
                if code == PORT_IN_USE:
                    self._spawn()
                    continue
                if code is not None:
                    raise RuntimeError(f"the temporary Prefect server exited with status {code} while starting")
                try:
                    if client.get(f"{self.api_url}/health").status_code == 200:
                        return self.api_url
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the temporary Prefect server did not answer within {timeout_s:.0f} s "
                           "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)")

    def _spawn(self) -> None:
        import prefect
        from prefect.settings import get_current_settings

        from flows.server_watchdog import start_watchdog

        self.port = _free_port()
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
               **get_current_settings().to_environment_variables(exclude_unset=True)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(prefect.__file__).parent.parent),
             "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
             "--log-level", "error", "--lifespan", "on"], env=env)
        start_watchdog(self.process.pid)  # right away: a driver killed during the server's start-up is covered
        if self.niceness > 0:
            try:
                os.setpriority(os.PRIO_PROCESS, self.process.pid, self.niceness)
            except (OSError, AttributeError):  # not permitted, or no setpriority (Windows): run as is
                pass

    def stop(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after 5 s); a no-op once stopped."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _free_port() -> int:
    """A port the OS has free now; taken meanwhile, the server exits with PORT_IN_USE and gets another."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
