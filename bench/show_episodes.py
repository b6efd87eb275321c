"""Held-out episodes of two policies side by side, as Markdown: what the agent did before and after training.

    .venv/bin/python bench/show_episodes.py --workspace WS POLICY_BEFORE POLICY_AFTER [--n 3] [--prompts ID ...]

Reads each policy's latest evaluation rollouts (`stages.evaluate.compare` finds them) and prints, for `n`
prompts, both episodes: every message (assistant turns with their tool calls, tool results shortened),
the finish reason and the metric reward. Without --prompts it picks prompts the second policy solved and
the first did not, then others, in prompt order, so the choice is reproducible and not hand-picked.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import loopback  # bench/loopback.py: run under .ci/loopback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workspace", required=True)
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--prompts", nargs="*", default=None)
    args = ap.parse_args()

    from stages.evaluate import latest_eval, success_by_prompt
    from stages.reward_ref import RewardRef
    from storage.workspace import Workspace

    ws = Workspace.open(Path(args.workspace))
    metas = {p: latest_eval(ws, p, None) for p in (args.before, args.after)}
    rates = {p: success_by_prompt(ws, m) for p, m in metas.items()}
    shared = sorted(set(rates[args.before]) & set(rates[args.after]))
    if args.prompts:
        chosen = args.prompts
    else:
        improved = [p for p in shared if rates[args.after][p] > rates[args.before][p]]
        chosen = (improved + [p for p in shared if p not in improved])[: args.n]
    for prompt_id in chosen:
        for label, policy in (("before", args.before), ("after", args.after)):
            meta = metas[policy]
            metric = RewardRef.parse(meta["metric"])
            row = ws.query(
                "SELECT r.messages, r.finish_reason, r.num_turns, r.num_tool_calls, r.metadata, w.value FROM rollouts r "
                "LEFT JOIN rewards w ON w.rollout_id = r.rollout_id AND w.reward_name = $name AND w.reward_version = $version "
                "WHERE r.batch_id = $batch AND r.prompt_id = $prompt ORDER BY r.sample_idx LIMIT 1",
                {"name": metric.name, "version": metric.version, "batch": meta["rollouts"], "prompt": prompt_id}).to_pylist()[0]
            answer = json.loads(row["metadata"]).get("answer") if isinstance(row["metadata"], str) else row["metadata"].get("answer")
            print(f"**{prompt_id}, {label}** ({policy}): {row['num_turns']} turns, {row['num_tool_calls']} tool calls, "
                  f"finish `{row['finish_reason']}`, {metric.name} = {row['value']} (expected answer: {answer})\n")
            print("```")
            for m in row["messages"]:
                if m["role"] == "system":
                    continue
                text = (m["content"] or "").strip().replace("\n", " ")
                if m["role"] == "tool" and len(text) > 160:
                    text = text[:157] + "..."
                print(f"{m['role']:>9}: {text}")
            print("```\n")


if __name__ == "__main__":
    loopback.enter()
    main()
