"""Pooling per-group agreement counts into one number with a bootstrap interval over groups, checked against
hand-computed values (flows/views/agreement.py `measure`)."""

from __future__ import annotations

import pytest

from flows.views.agreement import measure


def row(group: str, pairs: int, concordant: int, discordant: int, ties: int, tau: float | None = None,
        batch: str = "ro-a") -> dict:
    return {"batch_id": batch, "group_id": group, "pairs": pairs, "concordant": concordant, "discordant": discordant,
            "ties": ties, "kendall_tau": tau}


def test_pooled_accuracy_counts_ties_half_and_taus_average_over_orderings() -> None:
    a = measure("r@1", [row("g0", 6, 5, 0, 1, tau=0.9129), row("g1", 4, 2, 2, 0), row("g1", 2, 2, 0, 0, tau=1.0)])
    assert (a.groups, a.pairs, a.concordant, a.discordant, a.ties) == (2, 12, 9, 2, 1)  # g1's two reviewers: one group
    assert a.accuracy == pytest.approx(9.5 / 12)
    assert a.ranked_groups == 2 and a.mean_tau == pytest.approx((0.9129 + 1.0) / 2)
    assert a.accuracy_low <= a.accuracy <= a.accuracy_high and a.tau_low <= a.mean_tau <= a.tau_high


def test_the_interval_comes_from_resampling_groups() -> None:
    # All groups alike: every resample gives the same numbers, so the interval is the point.
    same = measure("r@1", [row(f"g{i}", 3, 3, 0, 0, tau=1.0) for i in range(5)])
    assert (same.accuracy, same.accuracy_low, same.accuracy_high) == (1.0, 1.0, 1.0)
    assert (same.mean_tau, same.tau_low, same.tau_high) == (1.0, 1.0, 1.0)
    # Two equal-sized groups, one right, one wrong: resamples draw both (0.5, half the time) or one twice (0 or 1, a
    # quarter each), so the central 95 % runs from 0 to 1 around the point 0.5.
    split = measure("r@1", [row("g0", 2, 2, 0, 0), row("g1", 2, 0, 2, 0)])
    assert (split.accuracy, split.accuracy_low, split.accuracy_high) == (0.5, 0.0, 1.0)
    assert split.mean_tau is None and split.tau_low is None and split.ranked_groups == 0
    # Seeded: the same rows give the same interval.
    assert measure("r@1", [row("g0", 2, 2, 0, 0), row("g1", 2, 0, 2, 0)]) == split


def test_two_reviewers_on_the_same_episodes() -> None:
    from flows.views.agreement import overlap

    o = overlap("a and b", [(1.0, 1.0), (0.0, 0.0), (1.0, 0.0), (0.6, 0.4)])  # the last: good vs bad at 0.5
    assert (o.episodes, o.same_verdict, o.mean_abs_difference) == (4, 0.5, pytest.approx(0.3))
    assert 0.0 <= o.low <= 0.5 <= o.high <= 1.0
