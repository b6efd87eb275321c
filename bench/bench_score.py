"""Rescoring benchmark: score stored rollouts with a programmatic reward, then again unchanged.

    .venv/bin/python bench/bench_score.py [--workspace /tmp/rlops-bench]

Uses the workspace written by bench/bench_storage.py (1,000,000 rollouts in 100 batches; run that
first). Each measurement edits a reward (a file wrapping the built-in exact_match, with a fresh
constant in its source, so a new version) and rescores every rollout with it plus the weighted total,
then scores again with nothing changed (every part found in the catalog). `--workers 1,2` measures
in-process scoring and two Ray workers. Last, the judge's per-group overhead against a local HTTP
endpoint that answers instantly.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import loopback  # bench/loopback.py: run under .ci/loopback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rewards.base import RewardSpec  # noqa: E402
from stages import score  # noqa: E402
from stages.common import StageContext  # noqa: E402
from storage.schema import Rollout, from_table  # noqa: E402
from storage.workspace import Workspace  # noqa: E402


class InstantJudge(BaseHTTPRequestHandler):
    """Chat-completions endpoint that scores every trajectory id it is shown, at once."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = "\n".join(m["content"] for m in body["messages"] if isinstance(m.get("content"), str))
        import re

        ids = sorted(set(re.findall(r'<trajectory id="([^"]+)"', text)))
        content = json.dumps({"scores": [{"id": i, "score": 0.5, "explanation": "ok"} for i in ids]})
        out = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}],
                          "usage": {"prompt_tokens": 100, "completion_tokens": 20}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args) -> None:
        pass


def judge_overhead(ws: Workspace, batch: str, groups: int) -> None:
    from rewards.ruler import ruler_reward  # noqa: F401 - fail early if absent

    server = ThreadingHTTPServer(("127.0.0.1", 0), InstantJudge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    rollouts = from_table(ws.read_artifact(batch).slice(0, groups * 8), Rollout)
    import os

    os.environ["RLOPS_BENCH_JUDGE_KEY"] = "bench-key"
    spec = RewardSpec(fn="rewards.ruler.ruler_reward", params={
        "model": "bench-judge", "base_url": f"http://127.0.0.1:{server.server_port}/v1",
        "api_key_env": "RLOPS_BENCH_JUDGE_KEY", "cache_dir": None})
    from rewards.base import compute

    t0 = time.perf_counter()
    outcomes = compute(spec, rollouts)
    dt = time.perf_counter() - t0
    errors = sum(o.value is None for o in outcomes)
    print(f"judge overhead: {dt / groups * 1000:.1f} ms per group of 8 (instant local endpoint, {groups} groups, "
          f"{errors} errors)" + (f" first error: {next(o.error for o in outcomes if o.error)}" if errors else ""))
    server.shutdown()


EDITED_REWARD = """
from rewards.base import reward
from rewards.builtin import exact_match

EDIT = {edit!r}  # changing this text is the "edit": a new version, so every rollout is rescored


@reward(low=0.0, high=1.0, uses=(exact_match, EDIT))
def answer_match(rollout, key: str = "answer"):
    return exact_match(rollout, key)
"""


def rescore(ws: Workspace, batches: list[str], workers: int, tmp: Path) -> tuple[float, float]:
    """Edit the reward (new version), rescore every batch, then again unchanged: (full s, unchanged s)."""
    reward_file = tmp / f"edited_{workers}.py"
    reward_file.write_text(EDITED_REWARD.format(edit=f"{time.time_ns()}-{workers}"))
    config = score.ScoreConfig(rewards=[RewardSpec(fn=f"{reward_file}:answer_match")], workers=workers)
    ctx = StageContext(ws, run_name="bench-rescore")
    t0 = time.perf_counter()
    ref = score.run(config, ctx, batches)
    full = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = score.run(config, ctx, batches)
    unchanged = time.perf_counter() - t0
    assert again.cached and again.id == ref.id and not ref.cached
    return full, unchanged


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workspace", default="/tmp/rlops-bench")
    ap.add_argument("--workers", default="1,2", help="comma-separated score.workers values to measure")
    args = ap.parse_args()
    ws = Workspace.open(args.workspace)
    batches = [a["artifact_id"] for a in ws.catalog.artifacts("rollouts")]
    rows = sum(a["rows"] for a in ws.catalog.artifacts("rollouts"))
    if not batches:
        sys.exit("no rollouts: run bench/bench_storage.py first")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for workers in [int(w) for w in args.workers.split(",")]:
            full, unchanged = rescore(ws, batches, workers, Path(tmp))
            print(f"rescore {rows:,} rollouts in {len(batches)} batches after a reward edit (reward + total), "
                  f"workers={workers}: {full:.1f} s ({rows / full:,.0f} rollouts/s); "
                  f"again, no reward changed: {unchanged:.2f} s", flush=True)
    judge_overhead(ws, batches[0], groups=50)
    import resource

    print(f"peak RSS of the driver: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")


if __name__ == "__main__":
    loopback.enter()
    main()
