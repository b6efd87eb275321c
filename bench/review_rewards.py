"""A deliberately wrong reward, to show what disagreement with people's labels looks like (docs/BENCHMARKS.md,
"Agreement with labels"; tests/flows/views/test_review_agreement.py).

    score: {rewards: [{name: correct, fn: rewards.builtin.numeric_match},
                      {name: wrong, fn: bench/review_rewards.py:wrong}]}
"""

from __future__ import annotations

from rewards.base import reward
from rewards.builtin import numeric_match
from storage.schema import Rollout


@reward(low=0.0, high=1.0)
def wrong(rollout: Rollout) -> float:
    """1 for a wrong final number, 0 for the right one: `numeric_match` inverted, so it prefers every wrong answer."""
    value, _ = numeric_match(rollout)
    return 1.0 - value
