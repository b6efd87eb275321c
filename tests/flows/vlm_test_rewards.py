"""A reward for tests/flows/test_vlm_pipeline.py, in a file of its own so its version reaches only this file."""

from __future__ import annotations

from rewards.base import reward
from rewards.builtin import final_answer
from storage.schema import Rollout


@reward(low=0.0, high=1.0)
def answer_chars(rollout: Rollout) -> float:
    """A reward the random tiny model's answers vary on (their length in characters), so that each group has
    signal and the GRPO step trains; counting right (`correct`) is what the evaluation measures."""
    return min(1.0, len(final_answer(rollout) or "") / 40)
