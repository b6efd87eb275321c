"""The `human` reward: what people said of an episode in `rlops review`, scored and versioned like any reward.

    score:
      rewards:
        - {name: human, fn: rewards.human.human}                                # every reviewer, averaged
        - {name: human_alice, fn: rewards.human.human, params: {reviewers: [alice]}}

A labelled episode takes its label: the mean, over the chosen reviewers who labelled it, of the value their current
labels give it (storage/labels.py, the `label_values` view: the place in their ordering of its group, else their
grade). An episode none of them labelled has no value: null with the reason "not labelled", which the score stage
does not count as a failure (`partial`), and which GRPO, DPO and the weighted total leave out as any null.

The labels reach the function as its `labels` param, filled in from the workspace by the score stage
(`stages.score.in_workspace`), and params are part of a reward's version (docs/REWARDS.md, "Versions"). So a new
or changed label anywhere in the workspace gives a new version, which a rescore computes; unchanged labels give
the version already stored, and a rescore finds it in the catalog and computes nothing.
"""

from __future__ import annotations

from typing import Any

from rewards.base import reward
from storage.schema import Rollout


@reward(low=0.0, high=1.0, partial=True)
def human(rollout: Rollout, labels: dict[str, dict[str, float]] | None = None,
          reviewers: list[str] | None = None) -> tuple[float, dict[str, Any]]:
    """The mean of the chosen `reviewers`' values for this episode (all reviewers when None); `labels` is rollout
    id -> reviewer -> value, as the score stage fills it. Raises LookupError (a null "not labelled") without one."""
    given = (labels or {}).get(rollout.rollout_id, {})
    chosen = {who: value for who, value in given.items() if reviewers is None or who in reviewers}
    if not chosen:
        raise LookupError("not labelled" + (f" by {', '.join(reviewers)}" if reviewers else ""))
    return sum(chosen.values()) / len(chosen), {"reviewers": chosen}
