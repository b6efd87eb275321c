"""Inspect benchmark: how long `rlops inspect` takes on a large run, against a plain count over the same views.

    .venv/bin/python bench/bench_inspect.py [--workspace /tmp/rlops-bench-inspect] [--batches 50] [--per-batch 2000]

Writes (once) a run of `batches` training batches of hand-built tool-calling episodes
(tests/factories.py), each scored by two rewards, recorded as the pipeline records them. Then times,
in one process: opening the views and counting the run's rewards (the floor every query pays), the
top/bottom-5 selection per reward version with the episodes loaded and decoded, the HTML page, and a
version diff. The selection reads only the 2N chosen episodes whole, so it should stay a small
multiple of the count however large the run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import loopback  # bench/loopback.py: run under .ci/loopback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages import score  # noqa: E402
from stages.common import StageContext, base_policy  # noqa: E402
from storage.schema import to_table  # noqa: E402
from storage.workspace import Workspace  # noqa: E402
from tests.factories import tool_episode  # noqa: E402

RUN = "bench-inspect"


def build(ws: Workspace, batches: int, per_batch: int) -> None:
    from stages.policy.model import prepare_default_model

    policy = base_policy(ws, str(prepare_default_model()))
    ids = []
    for b in range(batches):
        batch = f"ro-bench{b:04d}"
        episodes = []
        for i in range(per_batch):
            ep = tool_episode(batch, i // 8, i % 8, answer="1987" if i % 3 else "1986")
            ep.policy_id = policy
            episodes.append(ep)
        ws.write_part("rollouts", batch, to_table(episodes), part="part-00000")
        ws.catalog.complete_artifact(batch, "rollouts", "rollout", [policy], "bench",
                                     meta={"step": b, "split": "train", "policy_id": policy})
        ws.catalog.record_stage_run({"stage": "rollout", "artifact_id": batch, "inputs": [policy],
                                     "status": "complete", "run_name": RUN})
        ids.append(batch)
    for limit in (40, 60):  # two versions of the length penalty, for the diff
        cfg = {"rewards": [{"name": "correct", "fn": "rewards.builtin.exact_match"},
                           {"name": "short", "fn": "rewards.builtin.length_penalty", "params": {"limit": limit}}]}
        score.run(score.ScoreConfig(**cfg), StageContext(ws, run_name=RUN), ids)
    ws.catalog.upsert_run(RUN, {"score": cfg}, None, "complete")


def timed(label: str, fn, results: dict[str, float]):
    start = time.perf_counter()
    out = fn()
    results[label] = time.perf_counter() - start
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workspace", default="/tmp/rlops-bench-inspect")
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--per-batch", type=int, default=2000)
    args = parser.parse_args()
    ws = Workspace.open(args.workspace)
    if ws.catalog.get_run(RUN) is None:
        start = time.perf_counter()
        build(ws, args.batches, args.per_batch)
        print(f"built {args.batches} x {args.per_batch} episodes in {time.perf_counter() - start:.0f} s", file=sys.stderr)

    from flows.views.inspect_render import write_diff_html, write_inspection_html
    from flows.views.inspection import diff_versions, inspect_run, read_views, run_batches

    inspect_run(ws, RUN, "correct", top=1)  # warm: imports, the tokenizer
    results: dict[str, float] = {}
    batches = list(run_batches(ws, RUN))

    def count() -> int:
        with read_views(ws) as con:
            return con.execute("SELECT count(*) FROM rewards WHERE list_contains(?, batch_id)", [batches]).fetchall()[0][0]

    rows = timed("open views + count the run's reward rows", count, results)
    view = timed("inspect: top/bottom 5 per version of 'total' (episodes loaded, tokens decoded)",
                 lambda: inspect_run(ws, RUN, "total", top=5), results)
    timed("  + write the HTML page", lambda: write_inspection_html(view, ws.root / "bench" / "total.html"), results)
    versions = [r.reward for r in inspect_run(ws, RUN, "short", top=1).rankings]
    diff = timed("diff: the 10 largest changes between the two 'short' versions",
                 lambda: diff_versions(ws, RUN, versions[0], versions[1], top=10), results)
    timed("  + write the HTML page", lambda: write_diff_html(diff, ws.root / "bench" / "diff.html"), results)

    floor = results["open views + count the run's reward rows"]
    print(f"run: {len(batches)} batches, {rows} reward rows, {diff.compared} episodes per version\n")
    print("| step | seconds | x count |\n| --- | --- | --- |")
    for label, seconds in results.items():
        print(f"| {label} | {seconds:.2f} | {seconds / floor:.1f} |")


if __name__ == "__main__":
    loopback.enter()
    main()
