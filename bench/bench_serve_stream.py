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
import tempfile
from pathlib import Path

import loopback  # bench/loopback.py: run under .ci/loopback
from bench_serve import EXAMPLE, REPO, add_shard_args, compare, make_workers


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
    add_shard_args(ap)
    args = ap.parse_args()

    from stages.rollout import TaskSpec

    prompts_file = str(EXAMPLE / "prompts.jsonl")
    workers, groups = make_workers(args, {
        "plain": TaskSpec(name="agent", params={"entry": f"{EXAMPLE / 'agent.py'}:rollout", "prompts": prompts_file}),
        "streamed": TaskSpec(name="agent", params={"entry": f"{REPO / 'bench' / 'doc_search_stream_agent.py'}:rollout",
                                                   "prompts": prompts_file}),
    })

    ttft_file = Path(tempfile.mkdtemp()) / "ttft.jsonl"
    os.environ["RLOPS_BENCH_TTFT_FILE"] = str(ttft_file)
    rate = compare(workers, groups, args.rounds)
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
