"""A base model's content fingerprint (stages.policy.model.fingerprint): the first call hashes every file of the
model folder, later calls only stat them (the per-file hashes are cached by path + size + mtime).

Run: `.venv/bin/python bench/bench_fingerprint.py [--model SmolLM2-135M-Instruct] [--repeats 5]`.
The cache is pointed at a fresh folder, so the first call is a cold one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import loopback  # bench/loopback.py: run under .ci/loopback


def main(model: str, repeats: int) -> None:
    from stages.policy import model as model_module

    folder = Path(model_module.resolve_model(model))  # resolved with the real cache (the prepared model)
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    with tempfile.TemporaryDirectory() as cache:
        # The fingerprint cache follows RLOPS_CACHE; the model folder is passed as a path, so it stays put.
        os.environ["RLOPS_CACHE"] = cache
        t0 = time.perf_counter()
        first = model_module.fingerprint(str(folder))
        cold = time.perf_counter() - t0
        warm = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            assert model_module.fingerprint(str(folder)) == first
            warm.append(time.perf_counter() - t0)
    median = statistics.median(warm)
    print(f"{folder.name}: {size / 1e6:.0f} MB in {sum(1 for p in folder.rglob('*') if p.is_file())} files")
    print(f"first call (hashes every file): {cold:.2f} s  ({size / 1e6 / cold:.0f} MB/s)")
    print(f"cached call (stat only), median of {repeats}: {median * 1e3:.2f} ms  = {median / cold:.5f}x the first")


if __name__ == "__main__":
    loopback.enter()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    main(args.model, args.repeats)
