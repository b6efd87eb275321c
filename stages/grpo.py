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

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from stages.checkpoints import Checkpoint, write_checkpoint
from stages.common import Added, ArtifactRef, Operational, StageContext, identity, resolve_policy, run_stage
from stages.update.data import read_training_data
from stages.update import workers
from stages.update.train import load_for_update, make_optimizer, save_update
from stages.policy.lora import LoRASettings
from stages.reward_ref import RewardRef
from storage.checkpoints import local_copy
from storage.ids import config_hash


class GRPOConfig(BaseModel):
    """One GRPO update. Changing any field but the `Operational` ones changes the output checkpoint's id.
    The sampling temperature is not here: the rollouts record it, and the update uses theirs."""

    model_config = ConfigDict(extra="forbid")

    lr: float = 1e-4  # what the reference TRL run used for SmolLM2 LoRA
    epochs: int = 1  # passes over the batch, one optimizer step each; 1 = strictly on-policy
    micro_batch_size: int = Field(8, ge=1)  # at most this many sequences per forward/backward (gradients accumulate)
    # ... and at most this many padded tokens (None: no limit; a longer sequence goes alone): bounds the
    # activation memory whatever the episode lengths, e.g. 5 arithmetic answers of ~75 tokens or one
    # ~400-token doc_search episode. Measured on SmolLM2: 8 -> 4 sequences of ~75 tokens cut the
    # update's transient memory by ~45 % for ~10 % more time (docs/BENCHMARKS.md).
    micro_batch_tokens: int | None = Field(384, ge=1)
    # Keep only each decoder layer's input for backward and recompute the rest: far less activation
    # memory for ~1/3 more compute. Numerics are unchanged, so it is not part of the checkpoint id.
    activation_checkpointing: bool = Operational(True)
    # Data-parallel workers (Ray Train DDP, stages/update/workers.py); the update equals one worker's
    # up to float summation order, so it is not part of the checkpoint id.
    workers: int = Operational(1, ge=1)
    # Groups whose rewards all agree have advantage 0: skipping them saves their forward/backward and
    # leaves them out of the token mean. False trains on every completion (TRL's behaviour, whose token
    # mean counts their tokens too): the same gradient direction, scaled down by the zero-signal share.
    skip_zero_variance: bool = Added(True)
    # A batch whose groups all agree has no gradient. False: no optimizer step (the checkpoint equals its
    # parent's weights). True: AdamW still steps with zero gradients, so its momentum carries on, as in a
    # trainer that runs the loss over every completion (TRL's GRPOTrainer); costs no forward pass.
    step_without_signal: bool = Added(False)
    # The samples of a group continue one prompt: run it once per micro-batch, not once per sample
    # (stages.policy.logprobs.shared_prefix_logprobs). The same log-probs up to float rounding (~1e-5).
    share_prompts: bool = Operational(True)
    max_grad_norm: float = 1.0  # the common clip; a few outlier sequences cannot blow up a step
    weight_decay: float = 0.0  # decay on LoRA weights pulls toward the base for no measured gain (TRL's default)
    scale: Literal["group", "batch", "none"] = "group"  # GRPO's per-group std; "none" is Dr. GRPO
    baseline: Literal["mean", "rloo"] = "mean"  # GRPO's group mean; "rloo" leaves the sample out
    eps_low: float = 0.2  # PPO's clip range below 1
    eps_high: float = 0.28  # DAPO's clip-higher: rare tokens may still rise (arXiv 2503.14476)
    ratio_cap: float | None = 3.0  # dual-clip c=3 (arXiv 1912.09729): bounds the loss on stale/mismatched logprobs
    beta: float = 0.0  # no KL to the base (DAPO, Dr. GRPO); > 0 costs one more forward pass per step
    aggregation: Literal["token_mean", "seq_mean", "dr_grpo"] = "token_mean"  # DAPO's token-level mean
    lora: LoRASettings = Field(default_factory=LoRASettings)  # used only when the parent has no adapter


def run(config: GRPOConfig, ctx: StageContext, parent_policy: str, batches: list[str], reward: RewardRef) -> ArtifactRef:
    """Train `parent_policy` one GRPO step on `batches` scored by `reward` (without a version: the newest
    version scored on all of them); return the new checkpoint.

    The checkpoint id hashes the parent, the batch ids (order-insensitive), the config and the resolved
    reward name@version; a complete one is returned without training (cached=True).
    """
    batches = sorted(set(batches))
    reward = reward.resolve(ctx.ws, batches)

    def body(policy_id: str, mlflow_run_id: str) -> dict[str, float]:
        ctx.ws.tracker.set_tags(mlflow_run_id, {"rlops.reward": str(reward)})  # which reward version this run trained on
        data = read_training_data(ctx.ws, batches, reward, scale=config.scale, baseline=config.baseline,
                                  skip_zero_variance=config.skip_zero_variance)
        base_model, adapter_uri = resolve_policy(ctx.ws, parent_policy)
        # an object-store checkpoint is downloaded once per machine
        adapter_dir = local_copy(adapter_uri)
        resident = None
        if ctx.session is None:
            model, optimizer = load_for_update(base_model, adapter_dir, config)
        else:  # the run's resident model, holding the parent's adapter (stages/policy/session.py)
            resident = ctx.session.for_update(base_model, parent_policy, adapter_dir, config.lora)
            model, optimizer = resident.model, make_optimizer(resident.model, adapter_dir, config)

        history = workers.train(model, optimizer, data.samples, data.advantages, config, temperature=data.temperature,
                                ctx=ctx, base_model=base_model)
        for epoch, m in enumerate(history):
            ctx.ws.tracker.log_metrics(mlflow_run_id, {f"train/{k}": v for k, v in m.items()}, step=epoch)
        # Nothing to train on (every group agreed): every advantage is 0, and so are the loss and the clipping.
        metrics = {**data.metrics, "loss": 0.0, "clip_frac": 0.0,
                   "momentum_only_step": float(not data.samples and config.step_without_signal)}
        if history:  # last epoch's values; speed and first-pass ratio over the whole update
            seconds = sum(m["tokens"] / m["tokens_per_s"] for m in history)
            metrics.update(history[-1], first_pass_ratio_mean=history[0]["ratio_mean"],
                           tokens_per_s=sum(m["tokens"] for m in history) / seconds)

        step = ctx.ws.catalog.get_checkpoint(parent_policy)["step"] + 1
        trained_on = {"batches": batches, "reward": str(reward)}
        state = {"policy_id": policy_id, "parent_id": parent_policy, "step": step, "trained_on": trained_on,
                 "config": identity(config), "temperature": data.temperature, "epochs": history, "metrics": metrics}
        write_checkpoint(ctx, Checkpoint(policy_id, parent_id=parent_policy, base_model=base_model, kind="grpo", step=step,
                                         config_hash=config_hash(identity(config)), mlflow_run_id=mlflow_run_id,
                                         trained_on=trained_on),
                         save=lambda folder: save_update(folder, model, optimizer, state))
        if resident is not None:  # the next rollout uses these weights straight from memory
            ctx.session.updated(resident, policy_id)
        return metrics

    # The reward enters the id through `version`, keeping `inputs` a list of artifact ids.
    return run_stage(ctx, "grpo", "checkpoint", inputs=[parent_policy, *batches], config=config, body=body,
                     version=str(reward), meta={"reward": str(reward)})
