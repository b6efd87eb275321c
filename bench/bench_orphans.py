"""How fast the temporary Prefect server goes when its driver is SIGKILLed alone, and what its
watchdog costs while it waits.

    .venv/bin/python bench/bench_orphans.py [--repeats 5] [--idle 10]

Each repeat starts a driver that starts the server as `rlops run` does (`run_here`) and runs a flow
that waits; after `--idle` seconds (the watchdog's CPU time and memory are read over them) the
driver is SIGKILLed alone, and the time until the server process has exited is measured.
The Prefect home is shared by the repeats, so only the first pays the database migrations.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import loopback  # bench/loopback.py: run under .ci/loopback

import psutil

ROOT = Path(__file__).resolve().parents[1]
DRIVER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from prefect import flow
    from flows.prefect_flows import run_here

    @flow
    def wait(ready: str) -> None:
        Path(ready).touch()
        time.sleep(3600)

    run_here(wait, sys.argv[1])
""")


def _child(driver: psutil.Process, marker: str, timeout: float = 300) -> psutil.Process:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in driver.children(recursive=True):
            try:
                if marker in " ".join(p.cmdline()):
                    return p
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.05)
    raise TimeoutError(f"no child process matching {marker!r}")


def one(tmp: Path, idle: float) -> dict[str, float]:
    ready = tmp / "ready"
    ready.unlink(missing_ok=True)
    (tmp / "driver.py").write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PYTHONPATH=str(ROOT), PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="240")
    proc = subprocess.Popen([sys.executable, str(tmp / "driver.py"), str(ready)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        driver = psutil.Process(proc.pid)
        server = _child(driver, "prefect.server.api.server:create_app")
        watchdog = _child(driver, "flows.server_watchdog")
        while not ready.exists():
            time.sleep(0.05)
        before = sum(watchdog.cpu_times()[:2])
        time.sleep(idle)
        cpu = sum(watchdog.cpu_times()[:2]) - before
        rss = watchdog.memory_info().rss
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.perf_counter()
        proc.wait()
        gone, alive = psutil.wait_procs([server], timeout=60)
        latency = time.perf_counter() - killed
        if alive:
            raise RuntimeError("the server outlived its driver")
        psutil.wait_procs([watchdog], timeout=30)
        return {"exit_s": latency, "watchdog_cpu_per_s": cpu / idle, "watchdog_rss_mb": rss / 2**20}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--idle", type=float, default=10.0, help="seconds the watchdog's cost is measured over")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        rows = [one(Path(d), args.idle) for _ in range(args.repeats)]
    for key in rows[0]:
        values = [r[key] for r in rows]
        print(f"{key}: median {statistics.median(values):.4g} ({', '.join(f'{v:.3g}' for v in values)})")


if __name__ == "__main__":
    loopback.enter()
    main()
