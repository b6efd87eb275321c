"""Rewards: the protocol and `compute` (rewards.base), built-ins (rewards.builtin), the RULER judge (rewards.ruler).

Importing this package never imports torch/transformers; the judge's HTTP client is only imported
with `rewards.ruler`.
"""

from rewards.base import (
    Outcome,
    RewardSpec,
    compute,
    fill_params,
    group_reward,
    reward,
    reward_version,
    total_version,
    weighted_total,
)

__all__ = [
    "Outcome",
    "RewardSpec",
    "compute",
    "fill_params",
    "group_reward",
    "reward",
    "reward_version",
    "total_version",
    "weighted_total",
]
