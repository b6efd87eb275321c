"""Streamed vs non-streamed served doc_search episodes on SmolLM2-135M-Instruct (CPU), and streamed time
to first output.

    .venv/bin/python bench/bench_serve_stream.py [--prompts 4] [--group 8] [--max-new-tokens 48] [--rounds 2]

The same work both ways, through the real rollout stage worker and the policy service (uvicorn on
127.0.0.1, the real openai client, requests batched by the service): `prompts x group` doc_search
episodes (4 x 8 = 32 concurrent episodes) on the train split, run by
  - plain: examples/doc_search_openai/agent.py (non-streamed calls, as bench/bench_serve.py runs it);
  - streamed: bench/doc_search_stream_agent.py, the same agent with `stream: true` on every call.
Throughput is sampled tokens (loss_mask == 1) per second of the shard's wall time; the runs
alternate, `--rounds` times each, and the ratio is taken over the summed times (target >= 0.95).
Time to first output: per streamed call, from sending the request to the first content or tool-call
delta, under the batch's load; median and p90 over all calls, and over the calls whose turn had text
(a tool-call-only turn shows its output at the end of the turn, by design).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import loopback  # bench/loopback.py: run under .ci/loopback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "doc_search_openai"


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ttft_line(label: str, values: list[float]) -> str:
    if not values:
        return f"{label}: no calls"
    return (f"{label}: median {statistics.median(values) * 1000:.0f} ms, p90 {_pct(values, 0.9) * 1000:.0f} ms "
            f"over {len(values)} calls")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import pyarrow.compute as pc
    import torch

    from stages.policy.model import DEFAULT_MODEL, resolve_model
    from stages.rollout import RolloutConfig, RolloutWorker, TaskSpec
    from tasks.base import load_task

    torch.set_num_threads(args.threads)
    base = resolve_model(DEFAULT_MODEL)
    config = RolloutConfig(prompts_per_step=args.prompts, group_size=args.group, max_new_tokens=args.max_new_tokens,
                           max_total_tokens=1536, groups_per_shard=args.prompts, tool_timeout=5.0)
    prompts_file = str(EXAMPLE / "prompts.jsonl")
    tasks = {
        "plain": TaskSpec(name="agent", params={"entry": f"{EXAMPLE / 'agent.py'}:rollout", "prompts": prompts_file}),
        "streamed": TaskSpec(name="agent", params={"entry": f"{REPO / 'bench' / 'doc_search_stream_agent.py'}:rollout",
                                                   "prompts": prompts_file}),
    }
    prompts = load_task("doc_search").prompts("train")[: args.prompts]
    groups = list(enumerate(prompts))
    workers = {label: RolloutWorker(config, base, spec) for label, spec in tasks.items()}
    for worker in workers.values():
        worker.prepare(config, "base", None)

    ttft_file = Path(tempfile.mkdtemp()) / "ttft.jsonl"
    os.environ["RLOPS_BENCH_TTFT_FILE"] = str(ttft_file)
    totals = {label: [0.0, 0, 0, 0] for label in tasks}  # seconds, sampled tokens, episodes, turns
    for r in range(args.rounds):
        for label, worker in workers.items():
            t0 = time.perf_counter()
            table = worker.run_shard(f"bench-{label}-{r}", "train", groups, base_seed=1000 * r)
            seconds = time.perf_counter() - t0
            tokens = pc.sum(pc.list_flatten(table["loss_mask"])).as_py()
            turns = pc.sum(table["num_turns"]).as_py()
            errors = pc.sum(pc.cast(pc.equal(table["finish_reason"], "error"), "int64")).as_py()
            t = totals[label]
            t[0], t[1], t[2], t[3] = t[0] + seconds, t[1] + tokens, t[2] + table.num_rows, t[3] + turns
            print(f"round {r} {label}: {table.num_rows} episodes ({errors} errors), {turns / table.num_rows:.2f} turns, "
                  f"{tokens} sampled tokens in {seconds:.1f} s = {tokens / seconds:.1f} tok/s", flush=True)
    rate = {label: t[1] / t[0] for label, t in totals.items()}
    for label, t in totals.items():
        print(f"{label}: {t[2]} episodes, {t[3] / t[2]:.2f} turns/episode, {t[1]} tokens in {t[0]:.1f} s "
              f"= {rate[label]:.1f} tok/s, {t[2] / t[0]:.2f} episodes/s")
    print(f"streamed / plain served throughput: {rate['streamed'] / rate['plain']:.3f} (target >= 0.95)")

    calls = [json.loads(line) for line in ttft_file.read_text().splitlines()] if ttft_file.exists() else []
    print(_ttft_line("time to first output, streamed, all calls", [c["first_output_s"] for c in calls
                                                                    if c["first_output_s"] is not None]))
    print(_ttft_line("time to first output, streamed, calls with text", [c["first_output_s"] for c in calls
                                                                          if c["text"] and c["first_output_s"] is not None]))
    print(_ttft_line("whole call, streamed", [c["total_s"] for c in calls]))


if __name__ == "__main__":
    loopback.enter()
    main()
