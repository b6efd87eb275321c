"""A reward for tests/flows/test_promotion.py, in a file of its own so its version reaches only this file."""

from __future__ import annotations

from rewards.base import reward
from rewards.builtin import numeric_match
from storage.schema import Rollout


@reward(low=0.0, high=1.0)
def wrong_answer(rollout: Rollout) -> float:
    """1 for any answer but the right number: the reward edit that must never ship."""
    right, _ = numeric_match(rollout)
    return 1.0 - right
