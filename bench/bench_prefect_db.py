"""What a new workspace's seeded Prefect database saves (flows/prefect_db.py): the CPU of a one-task flow run on
Prefect's temporary server, started on an empty Prefect home (the server runs every migration) vs on a home seeded
with the migrated empty database, as `rlops run` seeds a new workspace's; and what rlops' own start of that server
saves (flows/temp_server.py, "rlops"): the same flow called through `run_here` on a seeded home, so the driver
never imports Prefect's server.

    .venv/bin/python bench/bench_prefect_db.py [--repeats 3]

Each run is its own process (as `rlops run` is), its temporary server a child; reported per run: wall seconds and
the CPU seconds of the process and its children (the server included); the two kinds alternate, so a busy machine
slows both alike. The template is made before timing (once per Prefect version, in rlops' cache).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FLOW = """
from prefect import flow, task
import flows.prefect_flows  # what a `rlops run` driver imports, in every kind alike

@task
def one():
    return 1

@flow
def tiny():
    return one()

assert tiny() == 1
"""
# The same flow as `rlops run` calls one: through run_here, which starts the temporary server itself.
FLOW_RLOPS = FLOW.replace("assert tiny() == 1", "assert flows.prefect_flows.run_here(tiny) == 1")


def _run(home: Path, flow: str = FLOW) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", flow], env=env, check=True, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    from flows.prefect_db import seed

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        seed(Path(tmp) / "warm")  # the template, made once
        results: dict[str, list[tuple[float, float]]] = {"empty": [], "seeded": [], "rlops": []}
        for i in range(args.repeats):
            empty, seeded, ours = Path(tmp) / f"empty{i}", Path(tmp) / f"seeded{i}", Path(tmp) / f"rlops{i}"
            empty.mkdir()
            seed(seeded)
            seed(ours)
            results["empty"].append(_run(empty))
            results["seeded"].append(_run(seeded))
            results["rlops"].append(_run(ours, FLOW_RLOPS))
    for kind, runs in results.items():
        print(f"{kind:7s} wall {statistics.median(w for w, _ in runs):5.2f} s  cpu {statistics.median(c for _, c in runs):5.2f} s"
              f"  (runs: {', '.join(f'{w:.1f}/{c:.1f}' for w, c in runs)})")
    cpu = {k: statistics.median(c for _, c in v) for k, v in results.items()}
    wall = {k: statistics.median(w for w, _ in v) for k, v in results.items()}
    print(f"seeded / empty: wall {wall['seeded'] / wall['empty']:.2f}x, cpu {cpu['seeded'] / cpu['empty']:.2f}x")
    print(f"rlops' server / Prefect's (both seeded): wall {wall['rlops'] / wall['seeded']:.2f}x, "
          f"cpu {cpu['rlops'] / cpu['seeded']:.2f}x")


if __name__ == "__main__":
    main()
