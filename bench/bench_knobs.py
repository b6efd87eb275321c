"""Each training knob of issue 55 on the parity config against the default, same seed and budget, one after another.

    .ci/loopback .venv/bin/python bench/bench_knobs.py [--knobs default entropy overlong replay curriculum distill]
        [--seed 0] [--steps 40] [--every 10] [--workdir /tmp/rlops-bench-knobs] [--report-only]

Every run is configs/arithmetic_trl_parity.yaml (SmolLM2-135M-Instruct from the base, 4 prompts x 8 samples, at most
32 new tokens, lr 1e-4, 40 steps, greedy accuracy on 100 held-out additions) with `eval.every` 10 and
`rollout.seed` SEED, in a workspace of its own, through `rlops run`; the knob is the only change:

- default: as shipped.
- entropy: `grpo.entropy_coef: 0.001` (verl's default coefficient).
- overlong: DAPO's overlong shaping: `rewards.builtin.overlong_penalty` (max_tokens 32, buffer 8, weight 1) added to
  `correct`, and `grpo.mask_truncated: true`.
- replay: `replay: {enabled: true, min_groups: 2, max_age: 4}`.
- curriculum: `curriculum: {enabled: true, skip_solved: 1, skip_unsolved: 2}` on the parity task, whose 40 steps
  draw 160 of its 2000 train prompts once each (nothing to skip: it must equal the default, ids included), and
  the pair default-40 / curriculum-40 on a 40-prompt train split, where each prompt comes back every 10 steps.
- distill: `grpo.distill` from a teacher checkpoint (`--teacher`, e.g. the default run's final policy): on-policy
  distillation, reverse KL to the teacher as the per-token advantage beside GRPO's.

Per run: held-out accuracy at every evaluation, the seconds from the run's start to the first evaluation at or
above 53 % (None: never), wall seconds, and the final accuracy against the default's with the paired 95 % bootstrap
interval (`rlops eval compare`'s).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import loopback  # bench/loopback.py: run under .ci/loopback

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TARGET = 0.53


def variant(name: str, base: dict[str, Any], teacher: str | None) -> dict[str, Any]:
    """The parity config with one knob turned."""
    cfg = json.loads(json.dumps(base))
    if name == "entropy":
        cfg["grpo"]["entropy_coef"] = 0.001
    elif name == "overlong":
        cfg["score"]["rewards"].append({"name": "overlong", "fn": "rewards.builtin.overlong_penalty",
                                        "params": {"max_tokens": cfg["rollout"]["max_new_tokens"], "buffer": 8},
                                        "weight": 1.0})
        cfg["grpo"]["mask_truncated"] = True
    elif name == "replay":
        cfg["replay"] = {"enabled": True, "min_groups": 2, "max_age": 4}
    elif name.startswith("curriculum"):
        cfg["curriculum"] = {"enabled": True, "skip_solved": 1, "skip_unsolved": 2}
    elif name == "distill":
        if not teacher:
            raise SystemExit("distill needs --teacher (a checkpoint id, e.g. the default run's final policy)")
        cfg["grpo"]["distill"] = {"teacher": teacher, "coef": 1.0}
    if name.endswith("-40"):  # a small split: every prompt comes back every 10 steps
        cfg["task"]["params"]["n_train"] = 40
    return cfg


def final_by_prompt(workspace: Path) -> tuple[str, dict[str, float]]:
    """The run's final evaluated policy and its held-out accuracy prompt by prompt."""
    from stages.evaluate import by_prompt, latest_eval
    from storage.workspace import Workspace

    ws = Workspace.open(workspace)
    (policy,) = ws.query("SELECT policy_id FROM evals WHERE metric = 'accuracy' ORDER BY created_at DESC LIMIT 1"
                         ).to_pylist()
    return policy["policy_id"], {p: r["accuracy"] for p, r in by_prompt(ws, latest_eval(ws, policy["policy_id"], None)).items()}


def report(name: str, workspace: Path, default: Path | None) -> dict[str, Any]:
    """One run's row; against `default` (the default run's workspace), the paired difference of the final accuracies."""
    from stages.evaluate import bootstrap_interval
    from storage.settings import Settings
    from storage.sql import open_views

    views = open_views(Settings.from_env(str(workspace)))
    started, finished = views.con.sql("SELECT min(started_at), max(finished_at) FROM runs").fetchall()[0]
    evals = views.con.sql("SELECT coalesce(c.step, 0) AS step, e.value, e.created_at FROM evals e "
                          "LEFT JOIN checkpoints c USING (policy_id) WHERE e.metric = 'accuracy' ORDER BY e.created_at"
                          ).fetchall()
    reached = next(((t - started).total_seconds() for _, v, t in evals if v >= TARGET), None)
    final, accuracy = final_by_prompt(workspace)
    out: dict[str, Any] = {"knob": name, "seconds": round((finished - started).total_seconds(), 1),
                           "to_target_s": None if reached is None else round(reached, 1),
                           "evals": [[s, round(v, 3)] for s, v, _ in evals], "final": final}
    if default is not None and default != workspace:
        other_final, other = final_by_prompt(default)
        shared = sorted(set(accuracy) & set(other))
        diffs = [accuracy[p] - other[p] for p in shared]
        low, high = bootstrap_interval(diffs)
        out["vs_default"] = [round(sum(diffs) / len(diffs), 3), round(low, 3), round(high, 3)]
        out["same_final_policy"] = final == other_final
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--knobs", nargs="+", default=["default", "entropy", "overlong", "replay", "curriculum"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--teacher", help="distill: the teacher checkpoint id")
    parser.add_argument("--workdir", default="/tmp/rlops-bench-knobs")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()

    import yaml

    from flows.config import read_yaml

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    base = read_yaml(REPO / "configs" / "arithmetic_trl_parity.yaml")
    base.update(steps=args.steps)
    base["eval"]["every"] = args.every
    base["rollout"]["seed"] = args.seed
    rows = []
    for name in args.knobs:
        workspace = work / f"ws-{name}-seed{args.seed}"
        config = work / f"{name}-seed{args.seed}.yaml"
        config.write_text(yaml.safe_dump(variant(name, base, args.teacher), sort_keys=False))
        if not args.report_only:
            subprocess.run([str(REPO / ".venv" / "bin" / "rlops"), "run", str(config), "--workspace", str(workspace)],
                           check=True, cwd=REPO)
        default = work / f"ws-{'default-40' if name.endswith('-40') else 'default'}-seed{args.seed}"
        rows.append(report(name, workspace, default if default.exists() else None))
    print(f"\n| knob (seed {args.seed}) | held-out accuracy by step | final - default [95 %] | time to {TARGET:.0%} s "
          "| wall s |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        steps = ", ".join(f"{s}: {v:.2f}" for s, v in r["evals"])
        d = r.get("vs_default")
        diff = f"{d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}]" if d else "-"
        print(f"| {r['knob']} | {steps} | {diff} | {r['to_target_s']} | {r['seconds']} |")


if __name__ == "__main__":
    loopback.enter()
    main()
