"""What Workspace.query's view cache saves (storage/sql.py `ViewCache`): the same small query asked repeatedly on a
workspace, with views made for every query (what Workspace.query did before) vs reused while nothing changed.

    .venv/bin/python bench/bench_views.py [--batches 20] [--rows 100] [--queries 50]

The workspace holds `--batches` rollout batches of `--rows` rows, each with two reward versions (bench_storage.py's
synthetic data, written through the real write path). Reported: milliseconds per query each way, the ratio, and a
query after a catalog change (the views made again).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_storage import reward_batch, rollout_batch  # noqa: E402
from storage.sql import open_views  # noqa: E402
from storage.workspace import Workspace  # noqa: E402

SQL = "SELECT count(*) AS n, avg(value) AS mean FROM rollouts JOIN rewards USING (rollout_id) WHERE reward_version = 'v1'"


def add(ws: Workspace, step: int, rows: int, rng: np.random.Generator) -> None:
    batch_id = f"ro-{step:05d}"
    table = rollout_batch(batch_id, rows, rng)
    ws.write_part("rollouts", batch_id, table, part="part-00000")
    ws.catalog.complete_artifact(batch_id, "rollouts", "rollout", [], "bench", meta={"step": step})
    for v in ("v1", "v2"):
        r = reward_batch(batch_id, table["rollout_id"], v, (rng.random(rows) < 0.3).astype(np.float64))
        sid = r["score_batch_id"][0].as_py()
        ws.write_part("rewards", sid, r, part="part-00000")
        ws.catalog.complete_artifact(sid, "rewards", "score", [batch_id], "bench")


def per_query_ms(fn, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--rows", type=int, default=100)
    ap.add_argument("--queries", type=int, default=50)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        ws = Workspace.open(Path(tmp) / "ws")
        for step in range(args.batches):
            add(ws, step, args.rows, rng)

        def fresh():
            views = open_views(ws.settings)
            try:
                return views.con.sql(SQL).to_arrow_table()
            finally:
                views.con.close()

        assert fresh() == ws.query(SQL)
        made = per_query_ms(fresh, args.queries)
        cached = per_query_ms(lambda: ws.query(SQL), args.queries)
        add(ws, args.batches, args.rows, rng)
        start = time.perf_counter()
        after_change = ws.query(SQL)
        changed = (time.perf_counter() - start) * 1000
        assert after_change == fresh()
    print(f"{args.batches} batches x {args.rows} rollouts, 2 reward versions; {args.queries} queries each way")
    print(f"views made per query: {made:7.2f} ms/query")
    print(f"views reused:         {cached:7.2f} ms/query  ({made / cached:.1f}x faster)")
    print(f"first query after a catalog change (views made again): {changed:.2f} ms")


if __name__ == "__main__":
    main()
