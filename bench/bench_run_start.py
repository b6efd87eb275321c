"""How long `rlops run` takes to start its first stage, with and without importing the model stack while the temporary
Prefect server boots (flows/prefect_flows.py `run_here`, `PRELOAD`), in turns, fresh workspaces.

    .ci/loopback .venv/bin/python bench/bench_run_start.py [--reps 3]

Each run is the parity config cut to one step on 4 evaluation prompts (`rlops run configs/arithmetic_trl_parity.yaml
--set steps=1 --set eval.n_prompts=4`), the default model; "none" is the same command with the preload emptied
(`flows.prefect_flows.PRELOAD = {}`: the server's start-up waited for, then the imports). Prints, per variant,
the median seconds from the process's start to its exit (the figure: the same work, minus what overlapped), to its
first stage's start (about the same in both: without the preload the first stage does the imports itself), and the CPU
seconds of the run and its children (the server included).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import loopback  # bench/loopback.py: run under .ci/loopback

ROOT = Path(__file__).resolve().parent.parent
DRIVER = """
import sys
import flows.prefect_flows as p
if sys.argv[1] == "none":
    p.PRELOAD = {}
from flows.cli import main
sys.exit(main(sys.argv[2:]))
"""


def one(variant: str, work: Path) -> dict[str, float]:
    from storage.settings import Settings
    from storage.sql import open_views

    ws = work / f"ws-{variant}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-c", DRIVER, variant, "run", str(ROOT / "configs" / "arithmetic_trl_parity.yaml"),
           "--workspace", str(ws), "--set", "steps=1", "--set", "eval.n_prompts=4"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    wall = time.time() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    first = open_views(Settings.from_env(str(ws))).con.execute("SELECT epoch(min(started_at)) FROM stage_runs").fetchone()[0]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"first_stage_s": first - start, "wall_s": wall, "cpu_s": cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    results: dict[str, list[dict[str, float]]] = {"preload": [], "none": []}
    with tempfile.TemporaryDirectory(prefix="rlops-run-start-") as tmp:
        for _ in range(args.reps):
            for variant in results:
                results[variant].append(one(variant, Path(tmp)))
    for variant, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        each = ", ".join(f"{r['wall_s']:.1f}" for r in runs)
        print(f"{variant}: exit at {med['wall_s']:.1f} s ({each}), first stage at {med['first_stage_s']:.1f} s, "
              f"CPU {med['cpu_s']:.1f} s", flush=True)


if __name__ == "__main__":
    loopback.enter()
    main()
