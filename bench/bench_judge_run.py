"""A run trained by the judge alone, beside the same run on the programmatic reward, one after the other.

    .ci/loopback .venv/bin/python bench/bench_judge_run.py [--judge SmolLM2-135M-Instruct] [--steps 40] \
        [--mode yes_no] [--no-reference] [--server rlops|llamacpp] [--runs judge,correct]
    # the 1.5B judge without a reference, on llama.cpp's server (`make llama-server`; the GGUF as it is):
    .ci/loopback .venv/bin/python bench/bench_judge_run.py --server llamacpp --judge $(.venv/bin/python \
        bench/get_qwen_judge.py --gguf) --no-reference

1. `rlops serve --base-model JUDGE` on a free 127.0.0.1 port; configs/arithmetic_judge.yaml pointed at it (the
   `judge` reward, by default the yes_no mode with the reference, the only training reward; `correct` scored
   beside it, weight 0).
2. When it ends, the judge is stopped and configs/arithmetic_trl_parity.yaml runs (the same task, seed, budget and
   evaluation, trained on `correct`).
3. Per run: held-out `correct` of the base and of every evaluated checkpoint, the final one against the base with
   its paired 95 % bootstrap interval (`rlops eval compare`'s), wall seconds (the `runs` table's); and for the judge run, how often the
   judge's reward agreed with `correct` on the training rollouts (pairwise, within groups), the seconds spent
   scoring (the score stage's, nearly all of it the judge's), and the drift curve the score stage recorded per step
   (`judge_drift`: agreement with `correct`, tied pairs, unordered groups; rewards/drift.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import loopback  # bench/loopback.py: run under .ci/loopback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_judge import start_llama  # noqa: E402
from bench_ruler import free_port, start_judge  # noqa: E402
from bench_traffic import machine_speed  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

AGREEMENT = """
WITH r AS (SELECT w.rollout_id, o.group_id, w.reward_name, w.value FROM rewards w JOIN rollouts o USING (rollout_id)
           WHERE w.reward_name IN ('judge', 'correct') AND o.split = 'train'),
p AS (SELECT j.group_id, j.rollout_id, j.value AS judge, c.value AS correct FROM r j JOIN r c USING (rollout_id)
      WHERE j.reward_name = 'judge' AND c.reward_name = 'correct' AND j.value IS NOT NULL)
SELECT count(*) AS pairs,
       avg(CASE WHEN (a.judge - b.judge) * (a.correct - b.correct) > 0 THEN 1.0
                WHEN a.judge = b.judge THEN 0.5 ELSE 0.0 END) AS agreement
FROM p a JOIN p b ON a.group_id = b.group_id AND a.rollout_id < b.rollout_id WHERE a.correct <> b.correct
"""


def run(config: Path, workspace: Path, steps: int) -> None:
    subprocess.run([str(REPO / ".venv" / "bin" / "rlops"), "run", str(config), "--workspace", str(workspace),
                    "--set", f"steps={steps}"], check=True, cwd=REPO)


def report(label: str, workspace: Path) -> dict[str, Any]:
    from stages.evaluate import compare
    from storage.sql import open_views
    from storage.settings import Settings
    from storage.workspace import Workspace

    views = open_views(Settings.from_env(str(workspace)))
    evals = views.con.sql("SELECT e.policy_id, coalesce(c.step, 0) AS step, e.value FROM evals e LEFT JOIN checkpoints c "
                          "USING (policy_id) WHERE e.metric = 'accuracy' ORDER BY e.created_at").fetchall()
    started, finished = views.con.sql("SELECT min(started_at), max(finished_at) FROM runs").fetchall()[0]
    out: dict[str, Any] = {"run": label, "seconds": round((finished - started).total_seconds(), 1),
                           "evals": [{"policy": p, "step": s, "correct": round(v, 3)} for p, s, v in evals]}
    if len(evals) >= 2:
        c = compare(Workspace.open(workspace), evals[0][0], evals[-1][0])
        out["final_vs_base"] = [round(c.difference, 3), round(c.low, 3), round(c.high, 3)]
    if label == "judge":
        pairs, agreement = views.con.sql(AGREEMENT).fetchall()[0]
        out["judge_vs_correct"] = {"pairs": pairs, "agreement": None if agreement is None else round(agreement, 3)}
        (scoring,) = views.con.sql("SELECT sum(epoch(finished_at - started_at)) FROM stage_runs "
                                   "WHERE stage = 'reward_set' AND status = 'complete'").fetchall()[0]
        out["score_seconds"] = round(scoring or 0.0, 1)
        # the training steps' scorings (an evaluation's groups are single rollouts: nothing to order)
        curve = views.con.sql("SELECT agreement, tied_pairs, degenerate_groups, pairs FROM judge_drift WHERE judge = "
                              "'judge' AND truth = 'correct' AND len(batches) = 1 AND degenerate_groups IS NOT NULL "
                              "ORDER BY completed_at").fetchall()
        r3 = lambda v: None if v is None else round(v, 3)  # noqa: E731
        out["drift"] = {"agreement": [r3(a) for a, _, _, _ in curve], "tied_pairs": [r3(t) for _, t, _, _ in curve],
                        "degenerate_groups": [r3(d) for _, _, d, _ in curve], "pairs": [p for *_, p in curve]}
        half = len(curve) // 2
        for name, part in (("first_half", curve[:half]), ("second_half", curve[half:])):
            weights = [(a, p * (1 - t)) for a, t, _, p in part if a is not None]
            total = sum(w for _, w in weights)
            out["drift"][name] = r3(sum(a * w for a, w in weights) / total) if total else None
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--judge", default="SmolLM2-135M-Instruct")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--mode", default="yes_no", help="the judge reward's mode (ranking, yes_no, scale, pairwise)")
    parser.add_argument("--no-reference", action="store_true", help="do not show the judge the answer")
    parser.add_argument("--report-only", action="store_true", help="report the runs already in --workdir")
    parser.add_argument("--workdir", default="/tmp/rlops-bench-judge-run")
    parser.add_argument("--server", choices=["rlops", "llamacpp"], default="rlops", help="what serves the judge")
    parser.add_argument("--llama-server", default=str(REPO / "build" / "llama.cpp" / "bin" / "llama-server"))
    parser.add_argument("--runs", default="judge,correct", help="which runs to make (the report covers both)")
    args = parser.parse_args()

    import yaml

    from flows.config import read_yaml
    from stages.policy.model import prepare_model
    from storage.settings import expand_cache

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = expand_cache(args.judge) if args.server == "llamacpp" else prepare_model(args.judge)
    port = free_port()
    data = read_yaml(REPO / "configs" / "arithmetic_judge.yaml")
    (judge,) = [r for r in data["score"]["rewards"] if r["name"] == "judge"]
    judge["params"].update(base_url=f"http://127.0.0.1:{port}/v1", weights=str(model_dir), mode=args.mode,
                           reference=not args.no_reference)
    config = work / "arithmetic_judge.yaml"
    config.write_text(yaml.safe_dump(data, sort_keys=False))

    print(machine_speed(), flush=True)
    runs = args.runs.split(",")
    if not args.report_only and "judge" in runs:
        if args.server == "llamacpp":
            server = start_llama(args.llama_server, str(model_dir), port, 4, 2, 4096, work / "llama.log")
        else:
            server = start_judge(work, str(model_dir), port)
        try:
            run(config, work / "ws-judge", args.steps)
        finally:
            server.terminate()
            server.wait(timeout=60)
    if not args.report_only and "correct" in runs:
        run(REPO / "configs" / "arithmetic_trl_parity.yaml", work / "ws-correct", args.steps)
    rows = [report(label, work / f"ws-{label}") for label in ("judge", "correct") if (work / f"ws-{label}").exists()]
    print("\n| trained on | held-out accuracy (correct) by step | final - base [95 %] | wall s | scoring s |\n"
          "| --- | --- | --- | --- | --- |")
    for r in rows:
        steps = ", ".join(f"{e['step']}: {e['correct']:.2f}" for e in r["evals"])
        diff = r.get("final_vs_base", [float("nan")] * 3)
        print(f"| {r['run']} | {steps} | {diff[0]:+.3f} [{diff[1]:+.3f}, {diff[2]:+.3f}] | {r['seconds']} "
              f"| {r.get('score_seconds', '')} |")


if __name__ == "__main__":
    loopback.enter()
    main()
