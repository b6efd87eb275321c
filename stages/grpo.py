"""GRPO stage: one policy-gradient update of a LoRA adapter on scored rollout batches.

    ref = run(GRPOConfig(), ctx, parent_policy="ck-...", batches=["ro-..."], reward=RewardRef("correct"))

`run` reads as the update does: read the scored batch (stages/update/data.py: group-relative
advantages, zero-variance groups skipped, the sampling temperature taken from the rollouts) ->
train (stages/update/train.py: ONE optimizer step per epoch over the whole batch, micro-batches
accumulating gradients scaled so the sum is the loss of the whole batch) -> save (the shared
checkpoint writer, stages/checkpoints.py: adapter + optimizer state, atomically, then registered
with its lineage). With the default epochs=1 the update is strictly on-policy (ratio 1, the clip
inactive); more epochs reuse the batch off-policy, where the clip matters. The next step loads the
saved optimizer state and continues it.

torch, transformers and peft are imported inside functions: importing this module is cheap.
"""

from __future__ import annotations

from stages.checkpoints import write_update
from stages.common import ArtifactRef, StageContext, resolve_policy, run_stage, vision_language_base
from stages.policy.vlm_episodes import load_vlm_for_update
from stages.reward_ref import RewardRef
from stages.update import workers
from stages.update.config import GRPOConfig
from stages.update.data import pixel_inputs, read_scored, sampling_temperature, staleness, training_data
from stages.update.distill import attach_teacher_logprobs, teacher_key
from stages.update.train import load_for_update, make_optimizer, save_update
from storage.checkpoints import local_copy
from storage.images import ImageStore


def run(config: GRPOConfig, ctx: StageContext, parent_policy: str, batches: list[str], reward: RewardRef) -> ArtifactRef:
    """Train `parent_policy` one GRPO step on `batches` scored by `reward` (without a version: the newest
    version scored on all of them); return the new checkpoint.

    The checkpoint id hashes the parent, the batch ids (order-insensitive), the config and the resolved
    reward name@version; a complete one is returned without training (cached=True).
    """
    batches = sorted(set(batches))
    reward = reward.resolve(ctx.ws, batches)
    visual = vision_language_base(ctx.ws, parent_policy)
    if visual and config.dtype not in (None, "float32"):  # before any compute
        raise ValueError("grpo.dtype sets a text model's base weights; a vision-language model trains in fp32: "
                         "leave grpo.dtype unset")

    def body(policy_id: str, mlflow_run_id: str) -> dict[str, float]:
        ctx.ws.tracker.set_tags(mlflow_run_id, {"rlops.reward": str(reward)})  # which reward version this run trained on
        base_model, adapter_uri = resolve_policy(ctx.ws, parent_policy)
        # an object-store checkpoint is downloaded once per machine
        adapter_dir = local_copy(adapter_uri)
        resident, vision = None, None
        if visual:  # from files: the run's resident model is a text model's (stages/policy/vlm_episodes.py)
            policy = load_vlm_for_update(base_model, adapter_dir, config.lora, ImageStore(ctx.ws.settings.images_dir))
            model, optimizer = policy.model, make_optimizer(policy.model, adapter_dir, config)
            vision = pixel_inputs(policy)  # each row's pixels rebuilt from its stored images
        elif ctx.session is None:
            model, optimizer = load_for_update(base_model, adapter_dir, config)
        else:  # the run's resident model, holding the parent's adapter (stages/policy/session.py)
            resident = ctx.session.for_update(base_model, parent_policy, adapter_dir, config.lora, config.dtype)
            model, optimizer = resident.model, make_optimizer(resident.model, adapter_dir, config)
        rows = read_scored(ctx.ws, batches, reward, images=vision is not None)
        if config.distill is not None:  # the teacher's log-probs, computed once per batch (stages/update/distill.py)
            attach_teacher_logprobs(ctx.ws, config.distill, rows, sampling_temperature(rows))
        data = training_data(rows, scale=config.scale, baseline=config.baseline, vision=vision,
                             # a teacher's signal is per token: every group trains, whatever its rewards
                             skip_zero_variance=config.skip_zero_variance and config.distill is None,
                             mask_truncated=config.mask_truncated)

        result = workers.train(model, optimizer, data.samples, data.advantages, config, temperature=data.temperature,
                               ctx=ctx, base_model=base_model)
        history = result.history
        if result.placements:  # where the update workers ran, as rollout and score record theirs
            ctx.ws.tracker.set_tags(mlflow_run_id, {"rlops.ray_workers": ",".join(result.placements)})
        for epoch, m in enumerate(history):
            ctx.ws.tracker.log_metrics(mlflow_run_id, {f"train/{k}": v for k, v in m.items()}, step=epoch)
        # Nothing to train on (every group agreed): every advantage is 0, and so are the loss and the clipping;
        # no token was weighed, so no mismatch was seen (IS weight 1, nothing masked).
        metrics = {**data.metrics, "loss": 0.0, "clip_frac": 0.0, "is_weight_mean": 1.0, "is_masked_frac": 0.0,
                   "momentum_only_step": float(not data.samples and config.step_without_signal),
                   "staleness": float(staleness(ctx.ws, parent_policy, batches))}
        if history:  # last epoch's values; speed and first-pass ratio over the whole update
            seconds = sum(m["tokens"] / m["tokens_per_s"] for m in history)
            metrics.update(history[-1], first_pass_ratio_mean=history[0]["ratio_mean"],
                           tokens_per_s=sum(m["tokens"] for m in history) / seconds)

        write_update(ctx, kind="grpo", policy_id=policy_id, parent_id=parent_policy, base_model=base_model,
                     batches=batches, reward=reward, config=config, mlflow_run_id=mlflow_run_id,
                     state={"temperature": data.temperature, "epochs": history, "metrics": metrics},
                     save=lambda folder, state: save_update(folder, model, optimizer, state))
        if resident is not None:  # the next rollout uses these weights straight from memory (Ray actors: the store)
            ctx.session.updated(resident, policy_id, stored=result.stored)
        return metrics

    # The reward enters the id through `version` (and a distillation teacher's identity: a model folder's content).
    version = str(reward) + (f"|teacher={teacher_key(ctx.ws, config.distill.teacher)}" if config.distill else "")
    return run_stage(ctx, "grpo", "checkpoint", inputs=[parent_policy, *batches], config=config, body=body,
                     version=version, meta={"reward": str(reward)})
