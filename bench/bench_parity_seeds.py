"""The parity run's accuracy and wall time over several sampling seeds, with the sampler in fp32 and in bf16.

    .ci/loopback .venv/bin/python bench/bench_parity_seeds.py [--seeds 0 1 2] [--dtypes float32 bfloat16] [--set K=V ...]

Forty RL steps turn any change of the sampled numerics into another trajectory, so whether `rollout.dtype: bfloat16`
leaves the parity config's held-out accuracy unchanged is a question about a distribution, not one run: each
(seed, dtype) is `rlops run configs/arithmetic_trl_parity.yaml --set rollout.seed=S --set rollout.dtype=D` in a fresh
workspace, one after the other, nothing beside them, timed start to exit; then, untimed, each final adapter's
independent evaluation in fp32 (bench_parity_vs_trl.py's code: base + adapter, greedy, the 100 held-out prompts). The
seed moves every sampled episode (stages/rollout.py `base_seed`); the prompts per step and the evaluation set stay.
`--set grpo.dtype=bfloat16` (any `--set`) applies to every run, e.g. to study the update's precision the same way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import loopback  # bench/loopback.py: run under .ci/loopback
from bench_parity_vs_trl import CONFIG, ROOT, independent, rlops_result


def one_run(work: Path, seed: int, dtype: str, sets: list[str]) -> dict:
    ws = work / f"ws-{dtype}-{seed}"
    cmd = [str(ROOT / ".venv" / "bin" / "rlops"), "run", str(CONFIG), "--workspace", str(ws),
           "--set", f"rollout.seed={seed}", "--set", f"rollout.dtype={dtype}", *(a for kv in sets for a in ("--set", kv))]
    print("---", " ".join(cmd), file=sys.stderr, flush=True)
    start = time.time()
    code = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL).returncode
    wall = time.time() - start
    if code:
        return {"seed": seed, "dtype": dtype, "error": f"exit status {code}", "wall_s": wall}
    return {"seed": seed, "dtype": dtype, "wall_s": wall} | rlops_result(ws, start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every run (as `rlops run --set`)")
    ap.add_argument("--workdir", default="/tmp/rlops-parity-seeds")
    args = ap.parse_args()
    from stages.policy.model import prepare_default_model

    prepare_default_model()  # converted once, before any timing
    work = Path(args.workdir)
    subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir(parents=True)
    runs = [one_run(work, seed, dtype, args.sets) for seed in args.seeds for dtype in args.dtypes]  # in turns, seed by seed
    for r in runs:
        if "error" not in r:
            r["independent"] = independent(r["adapter"])
    if args.sets:
        print("every run with --set " + " --set ".join(args.sets))
    print("| seed | sampler | whole run | rollouts | evaluation rollouts | updates | held-out 0 / 20 / 40 | independent |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in runs:
        if "error" in r:
            print(f"| {r['seed']} | {r['dtype']} | FAILED ({r['error']}) after {r['wall_s']:.0f} s |")
            continue
        spent = r["spent_s"]
        print(f"| {r['seed']} | {r['dtype']} | {r['wall_s']:.1f} s | {spent.get('rollout', 0):.1f} s | "
              f"{spent.get('evaluation rollouts', 0):.1f} s | {spent.get('grpo', 0):.1f} s | "
              + " / ".join(f"{e['accuracy']:.2f}" for e in r["evals"]) + f" | {r['independent']:.2f} |")
    for dtype in args.dtypes:
        done = [r for r in runs if r["dtype"] == dtype and "error" not in r]
        if done:
            print(f"{dtype}: mean whole run {statistics.mean(r['wall_s'] for r in done):.1f} s, mean final held-out "
                  f"{statistics.mean(r['evals'][-1]['accuracy'] for r in done):.3f}, mean independent "
                  f"{statistics.mean(r['independent'] for r in done):.3f} over {len(done)} seeds")
    (work / "results.json").write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    loopback.enter()
    main()
