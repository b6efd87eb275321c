"""GRPO stage: one policy-gradient update of a LoRA adapter on scored rollout batches.

    ref = run(GRPOConfig(), ctx, parent_policy="ck-...", batches=["ro-..."], reward="correct")

Reads the rollouts of `batches` and their `reward` values, computes group-relative
advantages (stages/grpo_loss.py), skips groups whose rewards all agree (no signal), and
takes ONE optimizer step per epoch over the whole batch: micro-batches accumulate
gradients, each scaled so the sum equals the loss of the whole batch (token_mean divides by
the batch's total token count, not each micro-batch's). With the default epochs=1 the
update is strictly on-policy (ratio 1, the clip inactive); more epochs reuse the batch
off-policy, where the clip matters. The new adapter and the optimizer state are written to
`<workspace>/checkpoints/<policy_id>` atomically (temp folder + rename) and registered in
the catalog with their lineage; the next step loads that optimizer state and continues it.

torch, transformers and peft are imported inside functions: importing this module is cheap.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from stages.common import ArtifactRef, StageContext, resolve_policy, run_stage
from stages.model import resolve_model
from storage.checkpoints import local_copy, publish
from storage.ids import config_hash
from storage.workspace import Workspace

if TYPE_CHECKING:
    import torch

LORA_SEED = 0  # a fresh adapter's initial weights depend only on this: same inputs, same checkpoint


class LoRASettings(BaseModel):
    """The adapter created when the parent policy is a bare base model."""

    model_config = ConfigDict(extra="forbid")

    r: int = 16  # what the reference TRL LoRA runs on SmolLM2 use; ample for one task's behaviour
    alpha: int = 32  # alpha = 2r, the usual scaling (update scale alpha/r = 2)
    dropout: float = 0.0  # dropout would make the on-policy first-pass ratio differ from 1
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj"]  # attention only: small, the usual choice


class GRPOConfig(BaseModel):
    """One GRPO update. Changing any field changes the output checkpoint's id."""

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
    activation_checkpointing: bool = True
    # Data-parallel workers (Ray Train DDP, stages/grpo_workers.py); the update equals one worker's
    # up to float summation order, so it is not part of the checkpoint id.
    workers: int = Field(1, ge=1)
    max_grad_norm: float = 1.0  # the common clip; a few outlier sequences cannot blow up a step
    weight_decay: float = 0.0  # decay on LoRA weights pulls toward the base for no measured gain (TRL's default)
    scale: Literal["group", "batch", "none"] = "group"  # GRPO's per-group std; "none" is Dr. GRPO
    baseline: Literal["mean", "rloo"] = "mean"  # GRPO's group mean; "rloo" leaves the sample out
    eps_low: float = 0.2  # PPO's clip range below 1
    eps_high: float = 0.28  # DAPO's clip-higher: rare tokens may still rise (arXiv 2503.14476)
    ratio_cap: float | None = 3.0  # dual-clip c=3 (arXiv 1912.09729): bounds the loss on stale/mismatched logprobs
    beta: float = 0.0  # no KL to the base (DAPO, Dr. GRPO); > 0 costs one more forward pass per step
    aggregation: Literal["token_mean", "seq_mean", "dr_grpo"] = "token_mean"  # DAPO's token-level mean
    temperature: float = 1.0  # MUST equal the sampling temperature, or the ratio is wrong from step one
    lora: LoRASettings = Field(default_factory=LoRASettings)  # used only when the parent has no adapter


OPERATIONAL = {"activation_checkpointing", "workers"}  # settings that change cost, not results: left out of the id


@dataclass(frozen=True)
class Sample:
    """What training needs of a rollout: tokens, which were sampled, and their behaviour log-probs."""

    token_ids: list[int]
    loss_mask: list[int]  # 1 = sampled by the policy (trained on)
    behavior_logprobs: list[float]  # aligned with token_ids; used where loss_mask is 1


@dataclass
class _MicroBatch:
    index: torch.Tensor  # (b,) positions in the sample list, for the advantages
    input_ids: torch.Tensor  # (b, T) right-padded
    attention_mask: torch.Tensor  # (b, T)
    mask: torch.Tensor  # (b, T) bool: scored (sampled) positions
    behavior_logp: torch.Tensor  # (b, T)
    ref_logp: torch.Tensor | None = None  # (b, T), only when beta > 0


def _micro_batch_indices(lengths: list[int], size: int, max_tokens: int | None) -> list[list[int]]:
    """Sort by length and cut into micro-batches of at most `size` sequences and `max_tokens` padded
    tokens (count x longest), so each pads only to its own longest sequence."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out: list[list[int]] = []
    for i in order:
        # sorted ascending: adding i makes it the longest, so the padded size is (count + 1) * lengths[i]
        if out and len(out[-1]) < size and (max_tokens is None or (len(out[-1]) + 1) * lengths[i] <= max_tokens):
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _micro_batches(samples: list[Sample], size: int, device: Any, max_tokens: int | None = None) -> list[_MicroBatch]:
    """Tensors of each micro-batch of `_micro_batch_indices` (right-padded)."""
    import torch

    out = []
    for idx in _micro_batch_indices([len(s.token_ids) for s in samples], size, max_tokens):
        T = max(len(samples[i].token_ids) for i in idx)
        ids, attn = torch.zeros(len(idx), T, dtype=torch.long), torch.zeros(len(idx), T, dtype=torch.long)
        mask, blp = torch.zeros(len(idx), T, dtype=torch.bool), torch.zeros(len(idx), T)
        for row, i in enumerate(idx):  # right padding: positions stay 0..n-1, as at sampling time
            s, n = samples[i], len(samples[i].token_ids)
            ids[row, :n] = torch.tensor(s.token_ids)
            attn[row, :n] = 1
            mask[row, :n] = torch.tensor(s.loss_mask, dtype=torch.bool)
            blp[row, :n] = torch.tensor(s.behavior_logprobs)
        mask[:, 0] = False  # the first token has no predecessor to score it from
        out.append(_MicroBatch(torch.tensor(idx), ids.to(device), attn.to(device), mask.to(device), blp.to(device)))
    return out


def train_on_batch(model: Any, optimizer: Any, samples: list[Sample], advantages: torch.Tensor,
                   config: GRPOConfig) -> list[dict[str, float]]:
    """`config.epochs` optimizer steps of the GRPO loss on one batch (advantages: (N,), one per
    sample); gradients are accumulated over micro-batches so each step sees the whole batch.
    Returns one metrics dict per epoch: loss, clip fractions, ratio_mean (1.0 on the first pass
    when the behaviour log-probs came from this model), kl (beta > 0), grad_norm, tokens, tokens_per_s.
    """
    import torch

    from stages.grpo_loss import policy_loss
    from stages.logprobs import token_logprobs

    if not samples:
        return []
    device = next(model.parameters()).device
    batches = _micro_batches(samples, config.micro_batch_size, device, config.micro_batch_tokens)
    advantages = advantages.float().to(device)
    total_tokens = float(sum(int(b.mask.sum()) for b in batches))
    # dr_grpo's constant normaliser must be the same for every micro-batch: the longest completion.
    max_tokens = max(sum(s.loss_mask) for s in samples)
    if config.beta > 0:  # the reference (adapter off) does not change during the step: score it once
        with torch.no_grad(), model.disable_adapter():
            for b in batches:
                b.ref_logp = token_logprobs(model, b.input_ids, b.attention_mask, b.mask, config.temperature)
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    _set_activation_checkpointing(model, config.activation_checkpointing)
    history = []
    for _ in range(config.epochs):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        sums = dict.fromkeys(["loss", "clip_frac_low", "clip_frac_high", "ratio_mean", "kl_mean"], 0.0)
        for b in batches:
            _release_free_memory()
            logp = token_logprobs(model, b.input_ids, b.attention_mask, b.mask, config.temperature)  # (b, T)
            loss, stats = policy_loss(logp, b.behavior_logp, advantages[b.index.to(device)], b.mask,
                                      config.eps_low, config.eps_high, config.ratio_cap, b.ref_logp, config.beta,
                                      config.aggregation, max_tokens)
            # Scale each micro-batch's mean so the accumulated sum is the mean over the whole batch.
            n = stats["num_tokens"]
            weight = n / total_tokens if config.aggregation == "token_mean" else len(b.index) / len(samples)
            (loss * weight).backward()
            sums["loss"] += float(loss.detach()) * weight
            for k in ("clip_frac_low", "clip_frac_high", "ratio_mean", "kl_mean"):
                sums[k] += stats[k] * n / total_tokens  # token-weighted, like the stats themselves
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm))
        optimizer.step()
        seconds = time.perf_counter() - start
        metrics = {**{k: v for k, v in sums.items() if k != "kl_mean"},
                   "clip_frac": sums["clip_frac_low"] + sums["clip_frac_high"], "grad_norm": grad_norm,
                   "tokens": total_tokens, "tokens_per_s": total_tokens / seconds}
        if config.beta > 0:
            metrics["kl"] = sums["kl_mean"]
        history.append(metrics)
    return history


def _release_free_memory() -> None:
    """Hand memory freed by the last micro-batch back to the OS (glibc only; a no-op elsewhere).

    glibc keeps freed blocks of the previous backward pass in fragmented heaps, and the next micro-batch
    allocates around them: measured on SmolLM2, trimming between micro-batches lowers the update's peak
    RSS by ~200 MB at no measurable cost (a trim takes well under a millisecond here)."""
    global _malloc_trim
    if _malloc_trim is None:
        import ctypes
        import ctypes.util

        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


def _set_activation_checkpointing(model: Any, on: bool) -> None:
    from stages.logprobs import _causal_lm

    lm = _causal_lm(model)
    active = lm.is_activation_checkpointing if hasattr(lm, "is_activation_checkpointing") else lm.is_gradient_checkpointing
    # transformers 5 renamed gradient_* to activation_*; the old names still work, with a warning.
    if on and not active:
        enable = getattr(lm, "activation_checkpointing_enable", None) or lm.gradient_checkpointing_enable
        # Non-reentrant: gradients reach the LoRA weights without requiring grad on the inputs.
        enable({"use_reentrant": False})  # first parameter of both: the torch.utils.checkpoint kwargs
    elif not on and active:
        (getattr(lm, "activation_checkpointing_disable", None) or lm.gradient_checkpointing_disable)()


def add_lora(model: Any, lora: LoRASettings, seed: int = LORA_SEED) -> Any:
    """Wrap a transformers model in a fresh trainable LoRA adapter, initialised from `seed`
    (without touching the global RNG)."""
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def _load_trainable(base_model: str, adapter_dir: str | None, lora: LoRASettings) -> Any:
    # Not stages.policy.load_policy: training needs no tokenizer (tokens come from the rollouts),
    # and wants fp32 weights on every device (load_policy picks bf16 on cuda).
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(resolve_model(base_model), dtype=torch.float32).to(device)
    if adapter_dir is None:
        return add_lora(model, lora)
    return PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)


def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _resolve_reward(ws: Workspace, batches: list[str], reward: str) -> str:
    """'name@version' as given, or 'name' -> 'name@<version scored most recently on these batches>'."""
    if "@" in reward:
        return reward
    rows = ws.query(
        f"SELECT reward_version FROM rewards WHERE reward_name = {_sql_str(reward)} "
        f"AND batch_id IN ({', '.join(map(_sql_str, batches))}) "
        "GROUP BY reward_version ORDER BY max(scored_at) DESC LIMIT 1").to_pylist()
    if not rows:
        raise KeyError(f"no {reward!r} rewards for batches {batches}: run the score stage first")
    return f"{reward}@{rows[0]['reward_version']}"


def _read_scored(ws: Workspace, batches: list[str], reward: str) -> list[dict[str, Any]]:
    """One row per rollout of the batches with its reward `value` (None: unscored or errored);
    the latest score wins if a reward version was written twice."""
    name, _, version = reward.rpartition("@")
    missing = [b for b in batches if ws.catalog.get_artifact(b) is None]
    if missing:
        raise KeyError(f"rollout batches not complete or unknown: {missing}")
    in_batches = ", ".join(map(_sql_str, batches))
    return ws.query(f"""
        WITH r AS (
            SELECT rollout_id, value FROM rewards
            WHERE reward_name = {_sql_str(name)} AND reward_version = {_sql_str(version)} AND batch_id IN ({in_batches})
            QUALIFY row_number() OVER (PARTITION BY rollout_id ORDER BY scored_at DESC) = 1)
        SELECT ro.rollout_id, ro.batch_id, ro.group_id, ro.token_ids, ro.loss_mask, ro.behavior_logprobs,
               ro.sampling, r.value
        FROM rollouts ro LEFT JOIN r USING (rollout_id)
        WHERE ro.batch_id IN ({in_batches})
        ORDER BY ro.batch_id, ro.group_id, ro.sample_idx""").to_pylist()


def _training_data(rows: list[dict[str, Any]], config: GRPOConfig) -> tuple[list[Sample], torch.Tensor, dict[str, float]]:
    """Scored rows -> (samples of the groups with signal, their advantages (n,), data metrics).
    Rows without a reward value are dropped before the group statistics."""
    import torch

    from stages.grpo_loss import group_advantages, zero_variance_groups

    temps = {float(json.loads(r["sampling"] or "{}").get("temperature", 1.0)) for r in rows}
    if any(not math.isclose(t, config.temperature) for t in temps):
        raise ValueError(f"config.temperature={config.temperature} but the rollouts were sampled at {sorted(temps)}")
    scored = [r for r in rows if r["value"] is not None]
    if not scored:
        raise ValueError("no rollout of these batches has a value for this reward")
    rewards = torch.tensor([r["value"] for r in scored], dtype=torch.float32)  # (N,)
    groups = [(r["batch_id"], r["group_id"]) for r in scored]
    keep = ~zero_variance_groups(rewards, groups)  # (N,) bool; their advantages are 0 anyway
    advantages = group_advantages(rewards, groups, config.scale, config.baseline)[keep]  # (n,)
    samples = [Sample(r["token_ids"], r["loss_mask"], r["behavior_logprobs"])
               for r, k in zip(scored, keep.tolist()) if k]
    n_groups, n_zero = len(set(groups)), len({g for g, k in zip(groups, keep.tolist()) if not k})
    return samples, advantages, {
        "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std(unbiased=False)),
        "advantage_mean": float(advantages.mean()) if samples else 0.0,
        "advantage_std": float(advantages.std(unbiased=False)) if samples else 0.0,
        "groups": float(n_groups), "zero_variance_groups": float(n_zero), "frac_zero_variance_groups": n_zero / n_groups,
        "dropped_null_rewards": float(len(rows) - len(scored)), "trained_rollouts": float(len(samples)),
    }


def _clear_stale_tmp(final: Path) -> None:
    """Remove temp folders of this checkpoint left by killed runs (their process is gone)."""
    for tmp in final.parent.glob(f"{final.name}.tmp-*"):
        try:
            os.kill(int(tmp.name.rsplit("-", 1)[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)


def _save_checkpoint(final: Path, model: Any, optimizer: Any, state: dict[str, Any]) -> None:
    """Adapter (safetensors) + optimizer.pt + trainer_state.json, written to a temp folder and
    renamed, so `final` never holds a half-written checkpoint."""
    import torch

    _clear_stale_tmp(final)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
    # A complete folder may already sit under the final name (forced rerun, or a run killed
    # after the rename but before registering); a directory rename needs an absent target.
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)


def run(config: GRPOConfig, ctx: StageContext, parent_policy: str, batches: list[str], reward: str) -> ArtifactRef:
    """Train `parent_policy` one GRPO step on `batches` scored by `reward` ("name@version", or
    "name" for the version most recently scored on these batches); return the new checkpoint.

    The checkpoint id hashes the parent, the batch ids (order-insensitive), the config and the
    resolved reward name@version; a complete one is returned without training (cached=True).
    """
    batches = sorted(set(batches))
    reward = _resolve_reward(ctx.ws, batches, reward)
    cfg = config.model_dump(exclude=OPERATIONAL)

    def body(policy_id: str, mlflow_run_id: str) -> dict[str, float]:
        import torch

        samples, advantages, metrics = _training_data(_read_scored(ctx.ws, batches, reward), config)
        base_model, adapter_uri = resolve_policy(ctx.ws, parent_policy)
        adapter_dir = local_copy(adapter_uri)  # an object-store checkpoint is downloaded once per machine
        model = _load_trainable(base_model, adapter_dir, config.lora)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                      lr=config.lr, weight_decay=config.weight_decay)
        parent_opt = Path(adapter_dir) / "optimizer.pt" if adapter_dir else None
        if parent_opt is not None and parent_opt.exists():  # continue Adam's moments from the parent step
            optimizer.load_state_dict(torch.load(parent_opt, map_location="cpu", weights_only=True))
            for group in optimizer.param_groups:  # the saved state carries the parent's lr; this config wins
                group.update(lr=config.lr, weight_decay=config.weight_decay)

        from stages import grpo_workers

        history = grpo_workers.train(model, optimizer, samples, advantages, config, ctx=ctx, base_model=base_model)
        for epoch, m in enumerate(history):
            ctx.ws.tracker.log_metrics(mlflow_run_id, {f"train/{k}": v for k, v in m.items()}, step=epoch)
        if history:  # last epoch's values; speed and first-pass ratio over the whole update
            seconds = sum(m["tokens"] / m["tokens_per_s"] for m in history)
            metrics.update(history[-1], first_pass_ratio_mean=history[0]["ratio_mean"],
                           tokens_per_s=sum(m["tokens"] for m in history) / seconds)

        step = ctx.ws.catalog.get_checkpoint(parent_policy)["step"] + 1
        final = ctx.ws.settings.checkpoints_dir / policy_id
        trained_on = {"batches": batches, "reward": reward}
        _save_checkpoint(final, model, optimizer, {"policy_id": policy_id, "parent_id": parent_policy, "step": step,
                                                   "trained_on": trained_on, "config": cfg, "epochs": history,
                                                   "metrics": metrics})
        ctx.ws.catalog.add_checkpoint({
            "policy_id": policy_id, "parent_id": parent_policy, "base_model": base_model, "kind": "grpo",
            "adapter_uri": publish(ctx.ws.settings, final), "step": step, "trained_on": trained_on,
            "config_hash": config_hash(cfg), "mlflow_run_id": mlflow_run_id, "run_name": ctx.run_name})
        return metrics

    # The reward enters the id through `version`, keeping `inputs` a list of artifact ids.
    return run_stage(ctx, "grpo", "checkpoint", inputs=[parent_policy, *batches], config=cfg, body=body,
                     version=reward, meta={"reward": reward})
