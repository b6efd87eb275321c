"""The `algorithm:` selector: which stage function and config a pipeline step's update runs.

    fn, config = update_stage(cfg)          # e.g. (grpo.run, RLOOConfig(...).to_grpo())
    call(f"{cfg.algorithm}-{step}", fn, config, ctx, parent_policy=p, batches=[...], reward=r)

Every update stage takes (config, ctx, parent_policy, batches, reward) and returns a checkpoint, so the
pipeline, the replay (`retrain`) and `rlops stage` call them alike. grpo, rloo and reinforce_pp all run the
grpo stage (they differ in the advantage only, stages/update/presets.py); dpo and ppo run their own stages.
"""

from __future__ import annotations

from typing import Any, Callable

from flows.run_config import RunConfig
from stages import dpo, grpo, ppo
from stages.common import ArtifactRef


def update_stage(cfg: RunConfig) -> tuple[Callable[..., ArtifactRef], Any]:
    """(stage function, its config) of the run's `algorithm`."""
    if cfg.algorithm == "grpo":
        return grpo.run, cfg.grpo
    if cfg.algorithm == "rloo":
        return grpo.run, cfg.rloo.to_grpo()
    if cfg.algorithm == "reinforce_pp":
        return grpo.run, cfg.reinforce_pp.to_grpo()
    if cfg.algorithm == "dpo":
        return dpo.run, cfg.dpo
    if cfg.algorithm == "ppo":
        return ppo.run, cfg.ppo
    raise ValueError(f"unknown algorithm {cfg.algorithm!r}")


def update_workers(cfg: RunConfig) -> int:
    """The update workers (stages/update/group.py) the run's update asks for (1 for updates that train in-process)."""
    _, config = update_stage(cfg)
    return getattr(config, "workers", 1)
