"""A reward for tests/stages/test_export.py, in a file of its own so its version reaches only this file."""

from __future__ import annotations

from rewards.base import reward
from rewards.builtin import final_answer
from storage.schema import Rollout


@reward(low=0.0, high=1.0)
def answer_chars(rollout: Rollout) -> float:
    """The answer's length in characters (up to 40): the random tiny model's answers vary in it, so each group
    has signal and the GRPO step moves the adapter far enough to change greedy replies."""
    return min(1.0, len(final_answer(rollout) or "") / 40)
