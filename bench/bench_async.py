"""Asynchronous steps (`max_staleness: K`): wall time per step, held-out accuracy against wall time, how much
generation and the update overlap, and peak memory per stage.

    .venv/bin/python bench/bench_async.py [--config configs/arithmetic_trl_parity.yaml] [--k 0 1 2] [--seeds 0 1 2]
        [--tis both|on|off] [--steps N] [--eval-every N] [--set key=value ...]

The lead's measured runs (quiet machine):
    bench/bench_async.py --config configs/arithmetic_trl_parity.yaml --k 0 1 2 --seeds 0 1 2 --tis off --eval-every 5
    bench/bench_async.py --config configs/arithmetic_trl_parity.yaml --k 2 --seeds 0 1 2 --tis on --eval-every 5
    bench/bench_async.py --config configs/doc_search.yaml --k 0 1 2 --seeds 0 --tis both --eval-every 5

Each (K, seed, TIS) runs `flows.pipeline.train` (direct stage calls, no Prefect) in its own subprocess (this
script re-invoked with `--child`), in a fresh workspace, with `max_staleness: K`, `rollout.seed: seed` and, with
TIS on, `grpo.correction.tis_cap: 2`. Every stage call is timed on the thread that made it: generation
(rollout, score) and training (grpo, evaluate) intervals give the share of the run's wall time during which both
sides were busy (`overlap`). A sampler thread reads the process's RSS every 50 ms and keeps each stage's peak
(the stage running on the training thread when both run); the process's peak RSS is its `ru_maxrss`.
Held-out accuracy is the config's eval metric at each evaluation (`--eval-every`), with the wall time it was
reached (from the start of the run, SFT and the first evaluations included); `t>=53%` is the first time at or
above 53 %, the parity target.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import loopback  # bench/loopback.py: run under .ci/loopback

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TARGET = 0.53


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _overlap(gen: list[tuple[float, float]], train: list[tuple[float, float]]) -> float:
    """Seconds during which some generation interval and some training interval both ran."""
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in gen for b0, b1 in train)


def child(args: argparse.Namespace) -> None:
    import yaml

    from flows import pipeline
    from flows.config import apply_overrides
    from flows.run_config import from_dict
    from stages.common import StageContext
    from storage.workspace import Workspace

    data = yaml.safe_load(Path(args.config).read_text())
    data = apply_overrides(data, [*args.set, f"max_staleness={args.k[0]}", f"rollout.seed={args.seeds[0]}",
                                  *([f"eval.every={args.eval_every}"] if args.eval_every else []),
                                  *([f"steps={args.steps}"] if args.steps else []),
                                  *(["grpo.correction.tis_cap=2.0"] if args.tis == "on" else [])])
    cfg = from_dict(data)
    stages: dict[str, list[tuple[float, float]]] = {}
    current = {"generation": None, "training": None}
    peaks: dict[str, int] = {}
    lock = threading.Lock()
    t0 = time.perf_counter()

    def timed(name: str, fn: Any, *a: Any, **kw: Any) -> Any:
        stage = name.split("-")[0]
        side = "generation" if stage in ("rollout", "score") else "training"
        with lock:
            current[side] = stage
        start = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            with lock:
                stages.setdefault(side, []).append((start - t0, time.perf_counter() - t0))
                stages.setdefault(stage, []).append((start - t0, time.perf_counter() - t0))
                current[side] = None

    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            rss = _rss_bytes()
            with lock:
                stage = current["training"] or current["generation"] or "other"
            peaks[stage] = max(peaks.get(stage, 0), rss)

    threading.Thread(target=sample, daemon=True).start()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        ctx = StageContext(Workspace.open(Path(tmp) / "ws"), run_name=cfg.name)
        pipeline.train(cfg, ctx, call=timed, on_step=lambda r: rows.append({**r, "t": time.perf_counter() - t0}))
    done.set()
    wall = time.perf_counter() - t0
    step_times = [r["t"] for r in rows if "step" in r]
    import resource

    evals = [(r["t"], r.get("accuracy")) for r in rows if "eval" in r]  # the eval metric's success rate
    print(json.dumps({"wall_s": wall, "step_ends": step_times, "evals": evals, "peaks": peaks,
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "overlap_s": _overlap(stages.get("generation", []), stages.get("training", [])),
                      "seconds": {k: sum(b - a for a, b in v) for k, v in stages.items()},
                      "staleness": [r.get("staleness") for r in rows if "step" in r],
                      "is_weight_mean": [r.get("is_weight_mean") for r in rows if "step" in r]}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "arithmetic_trl_parity.yaml"))
    p.add_argument("--k", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--tis", choices=["off", "on", "both"], default="off")
    p.add_argument("--steps", type=int, default=None, help="override the config's steps (smoke runs)")
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--set", nargs="*", default=[], help="more key=value overrides (e.g. eval.n_prompts=10)")
    p.add_argument("--child", action="store_true")
    args = p.parse_args()
    if args.child:
        return child(args)
    print(f"{'K':>2} {'seed':>4} {'TIS':>3} {'s/step':>7} {'wall':>7} {'gen s':>7} {'train s':>7} {'overlap':>7} "
          f"{'peak GB':>7} {'t>=53%':>7}  held-out (wall s: accuracy)  | peak RSS per stage (GB)")
    for k in args.k:
        for seed in args.seeds:
            for tis in (["off", "on"] if args.tis == "both" else [args.tis]):
                cmd = [sys.executable, __file__, "--child", "--config", args.config, "--k", str(k), "--seeds", str(seed),
                       "--tis", tis, "--set", *args.set]
                cmd += ["--steps", str(args.steps)] if args.steps else []
                cmd += ["--eval-every", str(args.eval_every)] if args.eval_every else []
                out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, check=True).stdout
                r = json.loads(out.strip().splitlines()[-1])
                ends = r["step_ends"]
                per_step = statistics.median(b - a for a, b in zip(ends, ends[1:])) if len(ends) > 1 else float("nan")
                reached = next((f"{t:.0f}" for t, acc in r["evals"] if acc is not None and acc >= TARGET), "-")
                peak = r["peak_rss"] / 1e9
                sec = r["seconds"]
                print(f"{k:>2} {seed:>4} {tis:>3} {per_step:>7.1f} {r['wall_s']:>7.0f} {sec.get('generation', 0):>7.0f} "
                      f"{sec.get('training', 0):>7.0f} {r['overlap_s'] / r['wall_s']:>7.1%} {peak:>7.2f} {reached:>7}  "
                      + " ".join(f"{t:.0f}:{acc:.0%}" for t, acc in r["evals"] if acc is not None)
                      + "  | " + " ".join(f"{s}={v / 1e9:.2f}" for s, v in sorted(r["peaks"].items())), flush=True)


if __name__ == "__main__":
    loopback.enter()
    main()
