"""What a complete reward version costs: `reward_version` (reach walk) vs hashing the function's own source.

    .venv/bin/python bench/bench_reward_version.py [--repeats 20]

The score stage computes every reward's version once per call (and `rlops run` once per step), so
this is paid per stage call, not per rollout. For each built-in reward and the RULER judge, in one
process: the median time of `reward_version(spec)` and of sha256 over `inspect.getsource(fn)` (the
old scheme, which missed helpers), their ratio, and how much code and how many values the reach holds.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import statistics
import sys
import time
from pathlib import Path

import loopback  # bench/loopback.py: run under .ci/loopback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rewards.base import RewardSpec, load_fn, reward_version  # noqa: E402
from rewards.reach import reach  # noqa: E402

SPECS = [
    RewardSpec(fn="rewards.builtin.numeric_match"),
    RewardSpec(fn="rewards.builtin.exact_match"),
    RewardSpec(fn="rewards.builtin.format_ok"),
    RewardSpec(fn="rewards.builtin.doc_retrieved"),
    RewardSpec(fn="rewards.ruler.ruler_reward", params={"model": "judge"}),
]


def median_seconds(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    t0 = time.perf_counter()
    reward_version(SPECS[0])  # the first call also reads installed packages' metadata (once per process)
    print(f"first call: {1000 * (time.perf_counter() - t0):.1f} ms")
    print("| reward | code items | values | libraries | reward_version | source hash only | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for spec in SPECS:
        fn = load_fn(spec.fn)
        found = reach(fn)
        full = median_seconds(lambda: reward_version(spec), args.repeats)
        old = median_seconds(lambda: hashlib.sha256(inspect.getsource(fn).encode()).hexdigest(), args.repeats)
        print(f"| {spec.name} | {len(found.code)} | {len(found.values)} | {', '.join(sorted(found.libraries)) or '-'} "
              f"| {1000 * full:.2f} ms | {1000 * old:.3f} ms | {full / old:.0f}x |")


if __name__ == "__main__":
    loopback.enter()
    main()
