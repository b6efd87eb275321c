"""Judge drift, watched: how far a judge's scores of one batch agree with a programmatic reward of the same rollouts.

    drift(judge, truth, groups)   # {"agreement": ..., "tied_pairs": ..., "pairs": ..., "degenerate_groups": ...}
    measures(drift_counts(...) + ...)   # several batches pooled: their counts added

A policy trained on a judge can learn what fools the judge while the true score falls (published GRPO runs with
non-reasoning judges did). The score stage (stages/score.py) measures every rlops group reward (a judge: RULER in any
mode, a ranker; not a peer's batch function) against every per-rollout reward of the config that is not people's
labels (a programmatic check: `correct`, a format reward) on each batch it scores, as a metric only: nothing trains
on it. GRPO uses a judge's order within a group only, so the measure is
about order, per pair of one group's rollouts that the programmatic reward tells apart:

    agreement          concordant / (concordant + discordant): the judge orders the pair as the truth does; ties
                       left out (0.5 is chance; NaN when the judge tied or skipped every pair)
    tied_pairs         the share of those pairs the judge scores the same (no signal where the truth has one)
    pairs              how many such pairs the batch had
    degenerate_groups  the share of the batch's groups (of two or more rollouts) where the judge gave no order at all:
                       every rollout the same score, or no score (an error) for any of them

These are the reward-set metrics `{judge}.agreement.{truth}`, `{judge}.tied_pairs.{truth}`,
`{judge}.pairs.{truth}` and `{judge}.degenerate_groups` (SQL: the `judge_drift` view; MLflow: the stage run's metrics
and the `judge/...` curves on the pipeline run). rewards/agreement.py's AGREEMENT_SQL is the same question over a
whole run's stored rewards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


COUNTS = ("concordant", "discordant", "tied", "pairs", "groups", "degenerate")


def drift_counts(judge: Sequence[float | None], truth: Sequence[float | None], groups: Sequence[str]) -> dict[str, int]:
    """The pair and group counts behind the measures, rollout i scoring `judge[i]` and `truth[i]` in group `groups[i]`
    (None or NaN: no value); counts of several batches add up (`measures` of their sum pools them)."""
    if not len(judge) == len(truth) == len(groups):
        raise ValueError(f"judge, truth and groups differ in length ({len(judge)}, {len(truth)}, {len(groups)})")
    missing = lambda v: v is None or (isinstance(v, float) and math.isnan(v))  # noqa: E731
    members: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    out = dict.fromkeys(COUNTS, 0)
    for rows in members.values():
        if len(rows) < 2:
            continue  # a group of one (an evaluation's rollouts) has no order to give or to miss
        out["groups"] += 1
        scores = [judge[i] for i in rows]
        out["degenerate"] += any(missing(s) for s in scores) or len(set(scores)) <= 1
        for a in range(len(rows)):
            for b in range(a + 1, len(rows)):
                i, j = rows[a], rows[b]
                if missing(truth[i]) or missing(truth[j]) or truth[i] == truth[j]:
                    continue
                out["pairs"] += 1
                if missing(judge[i]) or missing(judge[j]):
                    continue  # unjudged: in `pairs`, in none of the three below
                agree = (judge[i] - judge[j]) * (truth[i] - truth[j])
                out["concordant"] += agree > 0
                out["discordant"] += agree < 0
                out["tied"] += agree == 0
    return out


def measures(counts: dict[str, int]) -> dict[str, float]:
    """agreement, tied_pairs, pairs and degenerate_groups (the module docstring) from `drift_counts`."""
    ordered = counts["concordant"] + counts["discordant"]
    return {"agreement": counts["concordant"] / ordered if ordered else math.nan,
            "tied_pairs": counts["tied"] / counts["pairs"] if counts["pairs"] else math.nan,
            "pairs": float(counts["pairs"]),
            "degenerate_groups": counts["degenerate"] / counts["groups"] if counts["groups"] else math.nan}


def drift(judge: Sequence[float | None], truth: Sequence[float | None], groups: Sequence[str]) -> dict[str, float]:
    """The drift measures of one batch (the module docstring)."""
    return measures(drift_counts(judge, truth, groups))
