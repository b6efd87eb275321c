"""DPO stage: one preference-optimisation update of a LoRA adapter on scored rollout batches.

    ref = run(DPOConfig(), ctx, parent_policy="ck-...", batches=["ro-..."], reward=RewardRef("correct"))

It reads as grpo.py does: read (the scored rows -> preference pairs per group, stages/update/pairs.py) ->
train (TRL's DPOTrainer on the rollouts' exact tokens and loss masks, the parent policy as reference,
stages/update/dpo.py; a vision-language policy's pairs with their pixel inputs rebuilt from the image store)
-> save (the shared checkpoint writer: kind `dpo`, lineage = parent, batches, reward name@version). It takes
the same arguments as the grpo stage, so it serves offline (every stored batch of a run at once) and as a
pipeline step's update (`algorithm: dpo`, online DPO: each step's reference is the policy that sampled the
step's rollouts).

torch, transformers, trl and peft are imported inside functions: importing this module is cheap.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from stages.checkpoints import write_update
from stages.common import ArtifactRef, StageContext, resolve_policy, run_stage, vision_language_base
from stages.policy.vlm_episodes import load_vlm_for_update
from stages.reward_ref import RewardRef
from stages.update.data import pixel_inputs, read_scored
from stages.update.dpo import DPOConfig, pair_tokens, train_dpo
from stages.update.pairs import PreferencePair, preference_pairs
from storage.checkpoints import local_copy
from storage.images import ImageStore


def run(config: DPOConfig, ctx: StageContext, parent_policy: str, batches: list[str], reward: RewardRef) -> ArtifactRef:
    """Train `parent_policy` with DPO on the pairs of `batches` scored by `reward` (without a version: the newest
    version scored on all of them); return the new checkpoint (kind `dpo`).

    The id hashes the parent, the batch ids (order-insensitive), the config and the resolved reward
    name@version; a complete one is returned without training (cached=True). No pair (every group tied):
    the checkpoint holds the parent's weights, as a GRPO step without signal does.
    """
    batches = sorted(set(batches))
    reward = reward.resolve(ctx.ws, batches)
    visual = vision_language_base(ctx.ws, parent_policy)

    def body(policy_id: str, mlflow_run_id: str) -> dict[str, float]:
        ctx.ws.tracker.set_tags(mlflow_run_id, {"rlops.reward": str(reward)})
        rows = read_scored(ctx.ws, batches, reward, images=bool(visual))
        pairs, metrics = preference_pairs(rows, config.pairing, config.min_margin)
        base_model, adapter_uri = resolve_policy(ctx.ws, parent_policy)
        if visual:
            model, tokenizer, vision = _load_visual(ctx, base_model, local_copy(adapter_uri), config, rows, pairs)
        else:
            model, tokenizer, vision = *_load_text(base_model, local_copy(adapter_uri), config), None
        start = time.perf_counter()
        history = train_dpo(model, tokenizer, pairs, config, vision) if pairs else []
        seconds = time.perf_counter() - start
        for i, row in enumerate(history):
            ctx.ws.tracker.log_metrics(mlflow_run_id, {f"train/{k}": v for k, v in row.items()}, step=i)
        tokens = float(pair_tokens(pairs) * config.epochs)
        metrics.update(tokens=tokens, tokens_per_s=tokens / seconds if history else 0.0, optimizer_steps=float(len(history)))
        if history:  # the last step's TRL figures: loss, reward accuracy (chosen above rejected), margin
            last = history[-1]
            metrics.update(loss=last["loss"], **{k.replace("/", "_"): v for k, v in last.items()
                                                 if k.startswith("rewards/")})

        def save(folder: Path, state: dict) -> None:
            model.save_pretrained(folder, safe_serialization=True)
            (folder / "trainer_state.json").write_text(json.dumps(state, indent=2))

        write_update(ctx, kind="dpo", policy_id=policy_id, parent_id=parent_policy, base_model=base_model,
                     batches=batches, reward=reward, config=config, mlflow_run_id=mlflow_run_id, save=save,
                     state={"history": history, "metrics": metrics, "pairs": [[p.chosen_id, p.rejected_id] for p in pairs]})
        return metrics

    return run_stage(ctx, "dpo", "checkpoint", inputs=[parent_policy, *batches], config=config, body=body,
                     version=str(reward), meta={"reward": str(reward)})


def _load_text(base_model: str, adapter_dir: str | None, config: DPOConfig) -> tuple[Any, Any]:
    """A text policy to train (the parent's adapter, or a fresh `config.lora`) and its tokenizer."""
    from transformers import AutoTokenizer

    from stages.policy.model import resolve_model
    from stages.update.train import _load_trainable

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(base_model))
    return _load_trainable(base_model, adapter_dir, config.lora), tokenizer


def _load_visual(ctx: StageContext, base_model: str, adapter_dir: str | None, config: DPOConfig,
                 rows: list[dict[str, Any]], pairs: list[PreferencePair]) -> tuple[Any, Any, dict[str, Any]]:
    """A vision-language policy to train (`load_vlm_for_update`), its tokenizer, and the pixel inputs of every
    paired rollout by id, rebuilt from the image store before any training (`pixel_inputs`: ValueError when a
    row was recorded with another processor)."""
    policy = load_vlm_for_update(base_model, adapter_dir, config.lora, ImageStore(ctx.ws.settings.images_dir))
    rebuild, by_id = pixel_inputs(policy), {r["rollout_id"]: r for r in rows}
    vision = {i: rebuild(by_id[i]) for p in pairs for i in (p.chosen_id, p.rejected_id)}
    return policy.model, policy.processor.tokenizer, vision
