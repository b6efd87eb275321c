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


def test_short_evaluations_generate_in_one_call_and_long_ones_in_calls_of_32() -> None:
    from stages.evaluate import EvalConfig, groups_per_call
    from stages.rollout import RolloutConfig

    parity = RolloutConfig(max_total_tokens=160, groups_per_shard=4)
    assert groups_per_call(EvalConfig(), parity) == 204  # the parity config's 100 held-out prompts: one call
    assert groups_per_call(EvalConfig(samples=4), parity) == 51  # groups of 4 episodes
    assert groups_per_call(EvalConfig(), RolloutConfig(max_total_tokens=1536)) == 32  # doc_search: as before
    assert groups_per_call(EvalConfig(batch_tokens=1), RolloutConfig(groups_per_shard=40)) == 40
