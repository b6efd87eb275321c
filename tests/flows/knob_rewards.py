"""A reward for tests/flows/test_knobs_flow.py, in a file of its own so its version reaches only that file."""

from __future__ import annotations

from rewards.base import reward
from storage.schema import Rollout


@reward(low=0.0, high=1.0)
def scripted(rollout: Rollout, solved: list[str] = (), signal: list[str] = ()) -> float:
    """1 on every sample of a `solved` prompt; 0 / 1 alternating over a `signal` prompt's samples (a group with
    signal); 0 elsewhere (a group without)."""
    if rollout.prompt_id in solved:
        return 1.0
    return float(rollout.sample_idx % 2) if rollout.prompt_id in signal else 0.0
