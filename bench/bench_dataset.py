"""A 1,000,000-row Parquet dataset as a task (tasks/dataset.py): the config check and the first step's prompts, in
seconds and peak RSS, each in a fresh process; against reading the file into Python objects, which the task avoids.

    .venv/bin/python bench/bench_dataset.py [--rows 1000000] [--row-group 0] [--keep DIR]

The file is GSM8K-shaped: a ~250-character question, a worked answer, a numeric ground truth, a source and an
index (verl's columns would be the same size). `--row-group 0` writes pyarrow's default (one group for up to
1,048,576 rows: the worst case for reading a row deep in the file); a number writes groups of that many rows.
Each measured step runs in its own Python (`--measure`), so its peak RSS is its own:
- `config`: `load_run_config` of a config whose task is the file (the task is built: footers, the split hold-out);
- `first step`: the task built, step 0's 8 prompts read and their content digest (what the rollout stage does
  before generating), as `rollout.select_prompts` reads them;
- `deep step`: the same for a step whose prompts lie at the end of the file (the streaming cost);
- `to_pylist`: `pq.read_table(path).to_pylist()`, the whole file as Python objects (what is avoided).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEPS = {"config": None, "first step": 0, "deep step": -1, "to_pylist": None}


def write(path: Path, rows: int, row_group: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    a, b = rng.integers(10, 10_000, rows), rng.integers(10, 10_000, rows)
    filler = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    question = pa.array([f"{filler}{filler[:60]} How much is {x} plus {y}?" for x, y in zip(a.tolist(), b.tolist())])
    table = pa.table({"question": question,
                      "answer": pa.array([f"{x} + {y} = <<{x}+{y}={x + y}>>{x + y}\n#### {x + y}"
                                          for x, y in zip(a.tolist(), b.tolist())]),
                      "solution": pa.array((a + b).astype(str).tolist()),
                      "source": pa.array(["synthetic"] * rows),
                      "index": pa.array(np.arange(rows))})
    pq.write_table(table, path, **({"row_group_size": row_group} if row_group else {}))


def measure(kind: str, path: str) -> dict:
    t0 = time.perf_counter()
    if kind == "imports":  # the baseline: what importing the task's modules costs before any data is read
        import tasks.dataset  # noqa: F401
        import flows.run_config  # noqa: F401

        out = {}
    elif kind == "to_pylist":
        import pyarrow.parquet as pq

        n = len(pq.read_table(path).to_pylist())
        out = {"rows": n}
    elif kind == "config":
        from flows.run_config import load_run_config

        cfg = {"name": "big", "base_model": str(Path(path).parent), "task": {"name": "dataset", "params": {
            "path": path, "prompt": "question", "answer": "solution"}}, "steps": 1,
            "score": {"rewards": [{"name": "correct", "fn": "rewards.math.equivalent"}]}, "eval": {"metric": "correct"}}
        config = Path(path).with_suffix(".yaml")
        config.write_text(json.dumps(cfg))
        load_run_config(config)
        out = {}
    else:
        from stages.rollout import select_prompts
        from tasks.base import content_digest, load_task

        task = load_task("dataset", {"path": path, "prompt": "question", "answer": "solution"})
        train = task.prompts("train")
        step = 0 if kind == "first step" else len(train) // 8 - 1
        prompts = select_prompts(train, 8, step)
        out = {"train": len(train), "step": step, "digest": content_digest(task, prompts),
               "first_prompt": prompts[0].question[-30:]}
    out["seconds"] = round(time.perf_counter() - t0, 3)
    out["peak_rss_mb"] = peak_rss_mb()
    return out


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM: ru_maxrss would carry over the forking parent's peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--row-group", type=int, default=0, help="rows per row group (0: pyarrow's default)")
    parser.add_argument("--keep", help="write the file here and keep it")
    parser.add_argument("--measure", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-dataset-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"big-{args.rows}-{args.row_group}.parquet"
    t0 = time.perf_counter()
    if not path.exists():
        write(path, args.rows, args.row_group)
    print(f"{path}: {args.rows} rows, {path.stat().st_size / 1e6:.1f} MB, row groups of "
          f"{args.row_group or 'pyarrow default'} (written in {time.perf_counter() - t0:.1f} s)")
    # a bare interpreter with the same imports' baseline: what the task itself adds on top
    base = json.loads(subprocess.run([sys.executable, __file__, "--measure", "imports", str(path)],
                                     check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    print(f"{'imports':>12}: {base['seconds']:7.3f} s, peak RSS {base['peak_rss_mb']:7.1f} MB  (flows.run_config, tasks.dataset)")
    for kind in STEPS:
        run = subprocess.run([sys.executable, __file__, "--measure", kind, str(path)], capture_output=True, text=True)
        if run.returncode:
            print(run.stderr[-2000:])
            raise SystemExit(f"{kind} failed")
        out = json.loads(run.stdout.strip().splitlines()[-1])
        print(f"{kind:>12}: {out.pop('seconds'):7.3f} s, peak RSS {out.pop('peak_rss_mb'):7.1f} MB  {out}")


if __name__ == "__main__":
    main()
