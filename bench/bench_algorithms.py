"""GRPO, RLOO, REINFORCE++, DPO and PPO side by side on the same stored rollouts, then online.

    .ci/loopback .venv/bin/python bench/bench_algorithms.py configs/arithmetic.yaml --steps 8 [--no-sft]
    .ci/loopback .venv/bin/python bench/bench_algorithms.py configs/doc_search.yaml --steps 16
      [--algorithms grpo,rloo,reinforce_pp,dpo,ppo] [--modes offline,online] [--workspace DIR] [--set k=v ...]

1. source: the config's pipeline with `algorithm: grpo` for `--steps` steps (from the base model with
   `--no-sft`, as for arithmetic; from the SFT checkpoint otherwise, as for doc_search). Its start policy
   (base or SFT) is every row's starting point and the `rlops eval compare` reference.
2. offline (per algorithm): the source run's stored batches replayed step by step from the start policy,
   as `rlops retrain` does, with each algorithm's update: no generation, identical episodes for all. GRPO's
   offline row is the source run itself (its ids are the same, so the replay is cached).
3. online (per algorithm): the same pipeline with `algorithm: <name>` for the same number of steps. Its
   step 0 is the offline row's step 0 (the same batch, sampled by the same start policy, so the same ids:
   cached, and its `tokens`/`update s` are the offline run's); the runs part from step 1 on.

Same update budget: every update makes one pass over its step's data (the bench sets `ppo.epochs: 1`, as
GRPO's default epochs=1); the `tokens` column gives the sampled tokens each lineage trained on (DPO trains
only on its pairs' tokens, so it sees fewer). Each row runs in its own child process (this script with
`--child`), so `peak MB` is that child's peak RSS (os.wait4), which holds rollout, eval and update models
(PPO's critic is a second base model: its cost shows here). `update s` sums the update stage runs' wall
time (from the catalog); `wall s` is the child's whole time (generation and evals included). Accuracy is
each final policy's held-out accuracy (`eval:` section) with the 95 % bootstrap interval of its
difference to the start policy, prompt by prompt (stages.evaluate.compare).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import loopback  # bench/loopback.py: run under .ci/loopback

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ALGORITHMS = ("grpo", "rloo", "reinforce_pp", "dpo", "ppo")


def _config(args: argparse.Namespace, algorithm: str, name: str) -> Any:
    from flows.run_config import from_dict, load_run_config

    base = load_run_config(args.config, [*args.set, f"steps={args.steps}"])
    data = base.model_dump(mode="json", exclude_unset=False)
    data.update(name=name, algorithm=algorithm)
    if algorithm == "ppo":  # one pass over each step's data, as every other update makes
        data["ppo"] = {**data["ppo"], "epochs": 1}
    from flows.config import apply_overrides  # `--algo-set rloo:rloo.lr=3e-4`: that algorithm's rows only

    data = apply_overrides(data, [kv for a, _, kv in (x.partition(":") for x in args.algo_set) if a == algorithm])
    if args.no_sft:
        data["sft"] = None
    return from_dict(data)


def _lineage_figures(ws: Any, policies: list[str]) -> dict[str, float]:
    """Sampled tokens trained on and update seconds, summed over the lineage's update checkpoints."""
    tokens = seconds = 0.0
    for p in policies:
        tokens += float(ws.catalog.get_artifact(p)["meta"]["metrics"].get("tokens", 0.0))
        runs = [r for r in ws.catalog.stage_runs(p) if r["status"] == "complete"]
        if runs:
            seconds += (runs[0]["finished_at"] - runs[0]["started_at"]).total_seconds()
    return {"tokens": tokens, "update_s": seconds}


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One row's work in this process: `source`, `online:<alg>` or `offline:<alg>`."""
    from flows import pipeline
    from flows.algorithms import update_stage
    from stages.common import StageContext
    from stages.reward_ref import RewardRef
    from storage.workspace import Workspace

    ws = Workspace.open(args.workspace)
    mode, _, algorithm = args.child.partition(":")
    source_name = f"bench-{Path(args.config).stem}-source"
    if mode == "source" or mode == "online":
        name = source_name if mode == "source" else f"bench-{Path(args.config).stem}-{algorithm}-online"
        cfg = _config(args, algorithm or "grpo", name)
        result = pipeline.train(cfg, StageContext(ws, run_name=name), on_step=lambda row: None)
        start = result.sft or result.base
        return {"start": start, "final": result.final, "policies": result.policies,
                **_lineage_figures(ws, result.policies)}
    # offline: replay the source run's steps with this algorithm's update, from the source's start policy
    name = f"bench-{Path(args.config).stem}-{algorithm}-offline"
    cfg = _config(args, algorithm, name)
    start = json.loads(Path(args.workspace, "source.json").read_text())["start"]
    ctx = StageContext(ws, run_name=name)
    reward = RewardRef.configured(cfg.score, cfg.reward_name)
    update, update_config = update_stage(cfg)
    policy, policies = start, []
    with pipeline.resident(ctx) as ctx:
        for i, batches in enumerate(pipeline.step_batches(ctx, source_name)):
            policy = update(update_config, ctx, parent_policy=policy, batches=batches, reward=reward).id
            policies.append(policy)
        pipeline.evaluate_policy(cfg, ctx, policy)
    return {"start": start, "final": policy, "policies": policies, **_lineage_figures(ws, policies)}


def run_child(args: argparse.Namespace, job: str) -> dict[str, Any]:
    """`job` in a child process; adds its wall time and peak RSS."""
    out = Path(args.workspace) / f"{job.replace(':', '-')}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), args.config, "--steps", str(args.steps), "--child", job,
           "--workspace", args.workspace, *(["--no-sft"] if args.no_sft else []),
           *[x for s in args.set for x in ("--set", s)], *[x for s in args.algo_set for x in ("--algo-set", s)]]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{job} failed (exit {os.waitstatus_to_exitcode(status)})")
    row = json.loads(out.read_text())
    row.update(job=job, wall_s=time.perf_counter() - start, peak_mb=usage.ru_maxrss / 1024)
    return row


def table(ws_dir: str, rows: list[dict[str, Any]]) -> str:
    from stages.evaluate import compare
    from storage.workspace import Workspace

    ws = Workspace.open(ws_dir)
    lines = ["| mode | algorithm | accuracy start -> final | difference [95 % CI] | tokens | update s | wall s | peak MB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = compare(ws, r["start"], r["final"])
        mode, _, algorithm = r["job"].partition(":")
        lines.append(f"| {mode} | {algorithm} | "
                     f"{c.accuracy_a:.3f} -> {c.accuracy_b:.3f} | {c.difference:+.3f} [{c.low:+.3f}, {c.high:+.3f}] | "
                     f"{r['tokens']:.0f} | {r['update_s']:.1f} | {r['wall_s']:.0f} | {r['peak_mb']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    loopback.enter()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="a pipeline config (configs/arithmetic.yaml, configs/doc_search.yaml)")
    ap.add_argument("--steps", type=int, default=4, help="steps of every run (the GRPO source run and each online run)")
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    ap.add_argument("--modes", default="offline,online")
    ap.add_argument("--no-sft", action="store_true", help="start from the base model (drop the config's sft)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--algo-set", action="append", default=[], metavar="ALG:KEY=VALUE",
                    help="override for one algorithm's rows only, e.g. rloo:rloo.lr=3e-4 (repeatable)")
    ap.add_argument("--workspace", help="keep the workspace here (default: a temporary folder)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        result = child(args)
        Path(args.workspace, f"{args.child.replace(':', '-')}.json").write_text(json.dumps(result))
        return
    args.workspace = args.workspace or tempfile.mkdtemp(prefix="rlops-bench-algorithms-")
    algorithms = [a for a in args.algorithms.split(",") if a]
    unknown = set(algorithms) - set(ALGORITHMS)
    if unknown:
        raise SystemExit(f"unknown algorithms {sorted(unknown)}: {', '.join(ALGORITHMS)}")
    modes = args.modes.split(",")
    print(f"workspace {args.workspace}", file=sys.stderr)
    source = run_child(args, "source")  # the GRPO run: online grpo, and the batches every offline row replays
    Path(args.workspace, "source.json").write_text(json.dumps(source))
    rows = []
    for mode in ("offline", "online"):
        for a in algorithms:
            if mode in modes:  # GRPO's offline replay of its own batches is the source run (same ids)
                rows.append({**source, "job": f"{mode}:grpo"} if a == "grpo" else run_child(args, f"{mode}:{a}"))
                print(f"after {rows[-1]['job']}:\n{table(args.workspace, rows)}", file=sys.stderr, flush=True)
    print(f"\n{Path(args.config).stem}, {args.steps} steps, from {source['start']}"
          f" ({'the base model' if args.no_sft else 'the config sft checkpoint, if any'})")
    print(table(args.workspace, rows))


if __name__ == "__main__":
    main()
