"""The GRPO update's settings: `GRPOConfig`, the one typed config of the grpo stage.

It lives with the update (not in stages/grpo.py) because the training code reads it, and the stage
imports the training code: here both import it, and the update code never imports the stage.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from stages.common import Added, Operational
from stages.update.correction import Correction
from stages.policy.lora import LoRASettings

# PPO's step (stages/update/gae.py): every sampled token, or each assistant turn. Here, not with the torch code,
# so that a config check imports no torch.
Credit = Literal["token", "turn"]


class Distill(BaseModel):
    """`grpo.distill` (stages/update/distill.py): on-policy distillation from a teacher, per token."""

    model_config = ConfigDict(extra="forbid")
    teacher: str  # a checkpoint id of this workspace, or a model (name or folder) with the student's tokenizer
    coef: float = Field(1.0, gt=0)  # weight of the per-token reverse-KL advantage beside GRPO's


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
    # The frozen base model's weights during the update (None: float32). "bfloat16" keeps the LoRA weights, their
    # gradients, AdamW and the log-softmax in fp32 over a bf16 base: on a CPU with AMX/AVX512-BF16 one update
    # 1.12-1.31x faster, no gain measured on a whole run (docs/BENCHMARKS.md). Other numerics, so part of the checkpoint id when set. With `rollout.dtype:
    # bfloat16` a run's generation and update then share one resident model.
    dtype: Literal["float32", "bfloat16"] | None = Added(None)
    # Data-parallel workers (the resident update worker group, stages/update/group.py); the update equals one worker's
    # up to float summation order, so it is not part of the checkpoint id.
    workers: int = Operational(1, ge=1)
    # A resident vLLM engine sleeps during the update, giving its GPU memory to training. An asynchronous run
    # (max_staleness > 0) keeps it generating beside the trainer, so flows/pipeline.py turns this off there.
    sleep_generation: bool = Operational(True)
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
    baseline: Literal["mean", "rloo", "batch"] = "mean"  # GRPO's group mean; "rloo" leaves the sample out; "batch": REINFORCE++
    eps_low: float = 0.2  # PPO's clip range below 1
    eps_high: float = 0.28  # DAPO's clip-higher: rare tokens may still rise (arXiv 2503.14476)
    ratio_cap: float | None = 3.0  # dual-clip c=3 (arXiv 1912.09729): bounds the loss on stale/mismatched logprobs
    beta: float = 0.0  # no KL to the base (DAPO, Dr. GRPO); > 0 costs one more forward pass per step
    aggregation: Literal["token_mean", "seq_mean", "dr_grpo"] = "token_mean"  # DAPO's token-level mean
    # The surrogate (stages/update/loss.py SURROGATES): PPO's per-token clip (today's), GSPO's sequence-level
    # ratio (arXiv 2507.18071; pair with seq_mean and a narrow eps) or CISPO's clipped stop-gradient IS weight
    # (arXiv 2506.13585; every token keeps its gradient; pair with a wide eps_high). eps_* and ratio_cap apply to each.
    loss_mode: Literal["ppo_clip", "gspo", "cispo"] = Added("ppo_clip")
    # Off-policy correction from the behaviour log-probs (stages/update/correction.py): TIS cap, MIS and
    # icepop ranges. Off by default (today's ratio to the behaviour policy); turn TIS on for async runs.
    correction: Correction = Added(Correction())
    # An entropy bonus: loss - entropy_coef x the mean entropy of the policy's next-token distribution at the
    # sampled positions (verl's entropy_coeff; the entropy itself is logged either way as `entropy`). Keeps
    # exploration up where a group's samples collapse onto one answer; 0: off.
    entropy_coef: float = Added(0.0, ge=0.0)
    # DAPO's overlong filtering (arXiv 2503.14476): a rollout cut at the token budget (`truncated`) counts in its
    # group's statistics but is left out of the loss, so a reasoning cut short is not punished as if it were wrong.
    mask_truncated: bool = Added(False)
    # On-policy distillation: each sampled token's advantage gains coef x (log p_teacher - log p_behaviour), the
    # teacher's log-probs computed once per batch and stored (stages/update/distill.py). Every group trains, signal
    # or not (the teacher's is per token).
    distill: Distill | None = Added(None)
    lora: LoRASettings = Field(default_factory=LoRASettings)  # used only when the parent has no adapter
