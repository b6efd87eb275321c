"""doc_search episodes on SmolLM2-135M-Instruct (CPU): mean turns, tool calls and seconds per episode.

    .venv/bin/python bench/bench_doc_search.py [--prompts 4] [--group 4] [--sft-steps 40]

Runs the real rollout stage (multi-turn agent loop with the BM25 search/read tools) for the base
model and, with --sft-steps > 0, for a checkpoint warm-started on the task's scripted oracle
(the model then actually calls the tools, so episodes have several turns).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import loopback  # bench/loopback.py: run under .ci/loopback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--sft-steps", type=int, default=40)
    args = ap.parse_args()

    from stages import rollout, sft
    from stages.common import StageContext, base_policy
    from storage.workspace import Workspace
    from tasks.doc_search import write_oracle_dataset

    ws = Workspace.open(Path(tempfile.mkdtemp(prefix="rlops-docsearch-")) / "ws")
    ctx = StageContext(ws, run_name="bench-doc-search")
    policies = {"base": base_policy(ws, "SmolLM2-135M-Instruct")}
    if args.sft_steps:
        data = ws.root / "oracle.jsonl"
        write_oracle_dataset(data, split="train")
        t0 = time.perf_counter()
        policies["sft"] = sft.run(sft.SFTConfig(max_steps=args.sft_steps, batch_size=4, eval_fraction=0.0), ctx,
                                  "SmolLM2-135M-Instruct", str(data)).id
        print(f"SFT warm-start on the oracle: {args.sft_steps} steps in {time.perf_counter() - t0:.0f} s")
    cfg = rollout.RolloutConfig(prompts_per_step=args.prompts, group_size=args.group, max_new_tokens=96,
                                max_total_tokens=1536, groups_per_shard=args.prompts, tool_timeout=5.0)
    task = rollout.TaskSpec(name="doc_search")
    for label, policy in policies.items():
        t0 = time.perf_counter()
        ref = rollout.run(cfg, ctx, policy, task, split="test")
        seconds = time.perf_counter() - t0
        rows = ws.query(
            f"SELECT avg(num_turns) AS turns, avg(num_tool_calls) AS calls, avg(num_tokens) AS tokens, "
            f"avg(gen_seconds) AS episode_s, count(*) AS n, "
            f"avg(CASE WHEN finish_reason = 'answer' THEN 1 ELSE 0 END) AS answered "
            f"FROM rollouts WHERE batch_id = '{ref.id}'").to_pylist()[0]
        print(f"{label}: {rows['n']} episodes in {seconds:.1f} s ({seconds / rows['n']:.2f} s/episode batched), "
              f"mean turns {rows['turns']:.2f}, tool calls {rows['calls']:.2f}, tokens {rows['tokens']:.0f}, "
              f"answered {rows['answered']:.0%}")


if __name__ == "__main__":
    loopback.enter()
    main()
