"""Reward-model stage: a Bradley-Terry reward head trained from the preference pairs of scored rollout batches.

    ref = run(RMConfig(), ctx, base_policy="base-...", batches=["ro-..."], reward=RewardRef("correct"))

read (the scored rows -> pairs per group, stages/update/pairs.py: the higher reward is chosen; with `human`, a
person's ordering) -> train (stages/update/rm.py: LoRA on the base model's decoder and a scalar head) -> save (the
shared checkpoint writer: kind `rm`, the adapter and `head.pt`, and `rm.json` naming the base model's folder).
`rewards.rm.learned` scores episodes with it; its checkpoint id, in the reward's params, is the reward's version.

torch, transformers and peft are imported inside functions: importing this module is cheap.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from stages.checkpoints import write_update
from stages.common import ArtifactRef, StageContext, resolve_policy, run_stage
from stages.policy.model import resolve_model
from stages.reward_ref import RewardRef
from stages.update.data import read_scored
from stages.update.pairs import preference_pairs
from stages.update.ppo import load_value_model, save_value_model
from stages.update.rm import RMConfig, train_rm


def run(config: RMConfig, ctx: StageContext, base_policy: str, batches: list[str], reward: RewardRef) -> ArtifactRef:
    """Train a reward model on the base model of `base_policy` from the pairs of `batches` ordered by `reward`
    (without a version: the newest scored on all of them); return its checkpoint (kind `rm`). ValueError when the
    batches hold no pair (every group tied)."""
    batches = sorted(set(batches))
    reward = reward.resolve(ctx.ws, batches)

    def body(rm_id: str, mlflow_run_id: str) -> dict[str, float]:
        ctx.ws.tracker.set_tags(mlflow_run_id, {"rlops.reward": str(reward)})
        pairs, metrics = preference_pairs(read_scored(ctx.ws, batches, reward), config.pairing, config.min_margin)
        if not pairs:
            raise ValueError(f"no preference pair in {batches} under {reward}: every group's rewards are tied")
        base_model, _ = resolve_policy(ctx.ws, base_policy)
        critic = load_value_model(base_model, None, config.lora)
        start = time.perf_counter()
        history = train_rm(critic, pairs, config)
        for epoch, row in enumerate(history):
            ctx.ws.tracker.log_metrics(mlflow_run_id, {f"train/{k}": v for k, v in row.items()}, step=epoch)
        metrics.update(history[-1], seconds=time.perf_counter() - start)

        def save(folder: Path, state: dict) -> None:
            save_value_model(critic, folder)
            (folder / "rm.json").write_text(json.dumps({"base_model": str(Path(resolve_model(base_model)).resolve())}))
            (folder / "trainer_state.json").write_text(json.dumps(state, indent=2))

        write_update(ctx, kind="rm", policy_id=rm_id, parent_id=base_policy, base_model=base_model, batches=batches,
                     reward=reward, config=config, mlflow_run_id=mlflow_run_id, save=save,
                     state={"history": history, "metrics": metrics})
        return metrics

    return run_stage(ctx, "rm", "checkpoint", inputs=[base_policy, *batches], config=config, body=body,
                     version=str(reward), meta={"reward": str(reward)})
