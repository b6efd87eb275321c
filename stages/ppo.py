"""PPO stage: one update of the policy's LoRA adapter and of a learned critic on scored rollout batches.

    ref = run(PPOConfig(), ctx, parent_policy="ck-...", batches=["ro-..."], reward=RewardRef("correct"))

read (the scored rollouts as episodes; the sampling temperature from the rollouts) -> train
(stages/update/ppo.py: the critic's values at each step, GAE per token or per assistant turn, the clipped
policy loss and the critic's squared error) -> save (the shared checkpoint writer: kind `ppo`, the policy's
adapter and, beside it in `value/`, the critic's adapter and head; the next PPO step continues that critic).
Same arguments as the grpo stage, so `algorithm: ppo` runs it as each pipeline step's update.

torch, transformers and peft are imported inside functions: importing this module is cheap.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from stages.checkpoints import write_update
from stages.common import ArtifactRef, StageContext, resolve_policy, run_stage, vision_language_base
from stages.policy.vlm_episodes import refuse_unsupported, unsupported_with_vlm
from stages.reward_ref import RewardRef
from stages.update.data import read_scored, sampling_temperature
from stages.update.ppo import Episode, PPOConfig, load_value_model, save_value_model, train_ppo
from storage.checkpoints import local_copy


def run(config: PPOConfig, ctx: StageContext, parent_policy: str, batches: list[str], reward: RewardRef) -> ArtifactRef:
    """Train `parent_policy` (and its critic, fresh if the parent has none) one PPO update on `batches` scored by
    `reward`; return the new checkpoint (kind `ppo`). The id hashes the parent, the batch ids, the config and the
    reward name@version; a complete one is returned without training (cached=True)."""
    batches = sorted(set(batches))
    reward = reward.resolve(ctx.ws, batches)
    visual = vision_language_base(ctx.ws, parent_policy)
    if visual:
        refuse_unsupported(visual, unsupported_with_vlm(update="ppo"))

    def body(policy_id: str, mlflow_run_id: str) -> dict[str, float]:
        from stages.update.train import _load_trainable

        ctx.ws.tracker.set_tags(mlflow_run_id, {"rlops.reward": str(reward)})
        rows = read_scored(ctx.ws, batches, reward)
        temperature = sampling_temperature(rows)
        # An external agent's multi-segment rollout has no single sequence to give values along: left out.
        episodes = [Episode(r["token_ids"], r["loss_mask"], r["behavior_logprobs"], float(r["value"])) for r in rows
                    if r["value"] is not None and not r["segment_starts"] and any(r["loss_mask"])]
        base_model, adapter_uri = resolve_policy(ctx.ws, parent_policy)
        adapter_dir = local_copy(adapter_uri)
        policy = _load_trainable(base_model, adapter_dir, config.lora)
        critic = load_value_model(base_model, Path(adapter_dir) / "value" if adapter_dir else None, config.lora)
        start = time.perf_counter()
        history = train_ppo(policy, critic, episodes, config, temperature) if episodes else []
        seconds = time.perf_counter() - start
        for epoch, m in enumerate(history):
            ctx.ws.tracker.log_metrics(mlflow_run_id, {f"train/{k}": v for k, v in m.items()}, step=epoch)
        metrics = {"episodes": float(len(episodes)), "dropped": float(len(rows) - len(episodes)),
                   "reward_mean": sum(e.reward for e in episodes) / max(len(episodes), 1), "loss": 0.0}
        if history:
            metrics.update(history[-1], first_value_loss=history[0]["value_loss"],
                           tokens=history[0]["tokens"] * config.epochs,
                           tokens_per_s=history[0]["tokens"] * config.epochs / seconds)

        def save(folder: Path, state: dict) -> None:
            policy.save_pretrained(folder, safe_serialization=True)
            save_value_model(critic, folder / "value")
            (folder / "trainer_state.json").write_text(json.dumps(state, indent=2))

        write_update(ctx, kind="ppo", policy_id=policy_id, parent_id=parent_policy, base_model=base_model,
                     batches=batches, reward=reward, config=config, mlflow_run_id=mlflow_run_id, save=save,
                     state={"temperature": temperature, "epochs": history, "metrics": metrics})
        return metrics

    return run_stage(ctx, "ppo", "checkpoint", inputs=[parent_policy, *batches], config=config, body=body,
                     version=str(reward), meta={"reward": str(reward)})
