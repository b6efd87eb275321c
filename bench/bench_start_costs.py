"""What a process pays to start the things every run and test starts (issue 57's eighth stop), each the old way and
the new in turns:

    .ci/loopback .venv/bin/python bench/bench_start_costs.py [--reps 3]

- an OpenEnv app server until `/health` answers: `python -m uvicorn <app>` (openenv-core imports its Gradio web
  interface) against `python -m tasks.openenv_app <app>` (rlops' launcher: Gradio hidden unless switched on);
  CPU of the server process and wall time to answer;
- a workspace's views after a batch is added: fresh views (`open_views`) against bringing the cached ones up to date
  (`Workspace.query`'s `ViewCache`), on a workspace of a few files and of ~120, each followed by one query;
- a workspace's MLflow tracker (a new tracking store) before and after MLflow's schema head is cached;
- a catalog snapshot read by `pq.read_table` against `read_snapshot` (one Parquet file).
"""

from __future__ import annotations

import argparse
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
APP = "examples.environments.guess_env:app"


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def serve_once(module: str) -> tuple[float, float]:
    """(seconds until /health answers, CPU seconds of the server process) for one start of APP under `module`."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", module, APP, "--host", "127.0.0.1", "--port", str(port),
                             "--log-level", "warning"], cwd=ROOT)
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, f"{module} {APP} exited with {proc.returncode}"
            time.sleep(0.05)
        up = time.perf_counter() - start
    finally:
        before = _children_cpu()
        proc.terminate()
        proc.wait()
    return up, _children_cpu() - before


def views(files_batches: int, rounds: int = 10) -> tuple[float, float, int]:
    """Median ms of (fresh views + a query, cached views brought up to date + the query) after each added batch, and
    the number of files the views read at the end."""
    from storage import sql
    from storage.workspace import Workspace
    from tests.storage.conftest import add_batch

    ws = Workspace.open(Path(tempfile.mkdtemp()) / "ws")
    for i in range(files_batches):
        add_batch(ws, f"ro-{i}")
    ws.query("SELECT 1")
    fresh, refreshed = [], []
    for i in range(files_batches, files_batches + rounds):
        add_batch(ws, f"ro-{i}")
        t = time.process_time()
        ws.query("SELECT count(*) FROM rollouts")
        refreshed.append(time.process_time() - t)
        t = time.process_time()
        v = sql.open_views(ws.settings)
        v.con.sql("SELECT count(*) FROM rollouts").fetchall()
        v.con.close()
        fresh.append(time.process_time() - t)
    return statistics.median(fresh) * 1000, statistics.median(refreshed) * 1000, len(ws._views._views.stamps)


def tracker(cached: bool, n: int = 8) -> float:
    """Median ms to start a new workspace's MLflow tracker, with MLflow's schema head cached or found each time."""
    import functools

    from mlflow.store.db import utils

    from storage import tracking
    from storage.workspace import Workspace

    find = getattr(utils._get_latest_schema_revision, "__wrapped__", utils._get_latest_schema_revision)
    utils._get_latest_schema_revision = functools.cache(find) if cached else find
    real = tracking._schema_head_once
    tracking._schema_head_once = real if cached else (lambda: None)
    try:
        times = []
        for _ in range(n):
            ws = Workspace.open(Path(tempfile.mkdtemp()) / "ws")
            t = time.process_time()
            ws.tracker  # noqa: B018 - starting it is what is measured
            times.append(time.process_time() - t)
        return statistics.median(times) * 1000
    finally:
        tracking._schema_head_once = real


def snapshot_read(n: int = 200) -> tuple[float, float]:
    """ms per read of one catalog snapshot: pq.read_table of its bytes against read_snapshot."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from storage.catalog import read_snapshot
    from storage.workspace import Workspace
    from tests.storage.conftest import add_batch

    ws = Workspace.open(Path(tempfile.mkdtemp()) / "ws")
    for i in range(5):
        add_batch(ws, f"ro-{i}")
    path = ws.settings.snapshot_dir / "artifacts.parquet"
    old = lambda: pq.read_table(pa.BufferReader(path.read_bytes()))  # noqa: E731
    out = []
    for f in (old, lambda: read_snapshot(path)):
        f()
        t = time.process_time()
        for _ in range(n):
            f()
        out.append((time.process_time() - t) / n * 1000)
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    for rep in range(args.reps):
        for module in ("uvicorn", "tasks.openenv_app"):
            up, cpu = serve_once(module)
            print(f"OpenEnv app via {module:18s} round {rep + 1}: up in {up:.2f} s, server CPU {cpu:.2f} s", flush=True)
    for batches in (2, 30):
        fresh, refreshed, files = views(batches)
        print(f"views after a batch is added, up to {files} files: fresh {fresh:.1f} ms, brought up to date "
              f"{refreshed:.1f} ms (each with one query)", flush=True)
    print(f"a new workspace's tracker: {tracker(False):.1f} ms finding MLflow's schema head each time, "
          f"{tracker(True):.1f} ms with it cached", flush=True)
    old, new = snapshot_read()
    print(f"a catalog snapshot read: pq.read_table {old:.2f} ms, read_snapshot {new:.2f} ms")


if __name__ == "__main__":
    main()
