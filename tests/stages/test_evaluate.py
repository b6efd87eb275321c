"""The bootstrap interval behind `rlops eval compare` (the paired comparison itself runs in
tests/flows/test_cli_stages.py, on real eval rollouts)."""

from __future__ import annotations

import math

from stages.evaluate import bootstrap_interval


def test_bootstrap_interval_matches_the_normal_approximation_for_a_proportion() -> None:
    values = [1.0] * 20 + [0.0] * 10  # 30 prompts, 2/3 of them improved
    low, high = bootstrap_interval(values, resamples=20_000, seed=1)
    p, half = 2 / 3, 1.96 * math.sqrt((2 / 3) * (1 / 3) / 30)
    assert abs(low - (p - half)) < 0.04 and abs(high - (p + half)) < 0.04
    assert bootstrap_interval(values, resamples=20_000, seed=1) == (low, high)  # seeded


def test_paired_differences_that_cancel_give_an_interval_around_zero() -> None:
    low, high = bootstrap_interval([1.0, -1.0] * 15 + [0.0] * 10)
    assert low < 0 < high and abs(low + high) < 0.05
    assert bootstrap_interval([0.25] * 12) == (0.25, 0.25)  # no spread, no width
