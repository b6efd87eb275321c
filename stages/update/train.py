"""How a GRPO update trains: micro-batches, the accumulated clipped loss, one optimizer step per epoch.

    model, optimizer = load_for_update(base_model, adapter_dir, config)
    history = train_on_batch(model, optimizer, samples, advantages, config, temperature=1.0)
    save_update(folder, model, optimizer, state)

torch, transformers and peft are imported inside functions: importing this module is cheap.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.policy.lora import LoRASettings, add_lora
from stages.policy.model import MODEL_LOADING, resolve_model
from stages.update.config import GRPOConfig
from stages.update.data import Sample

if TYPE_CHECKING:
    import torch


@dataclass
class _MicroBatch:
    index: torch.Tensor  # (b,) positions in the sample list, for the advantages
    input_ids: torch.Tensor  # (b, T) right-padded
    attention_mask: torch.Tensor  # (b, T)
    mask: torch.Tensor  # (b, T) bool: scored (sampled) positions
    behavior_logp: torch.Tensor  # (b, T)
    ref_logp: torch.Tensor | None = None  # (b, T), only when beta > 0
    # (P,) a prompt every row continues; the rows then hold only what follows it (`shared_prefix_logprobs`)
    prefix: torch.Tensor | None = None
    # (b, T) the log-probs at the start of the step ("old"), kept from the first epoch's forward pass (no extra one)
    old_logp: torch.Tensor | None = None
    vision: Any = None  # the rows' image tensors (stages.policy.vlm.VisionInputs), for a vision-language policy
    teacher_logp: torch.Tensor | None = None  # (b, T) a distillation teacher's log-probs (stages/update/distill.py)

    def logprobs(self, model: Any, temperature: float, entropy: bool | str = False) -> Any:
        """Per-token log-probs (b, T) of the rows at the scored positions (0 elsewhere); with `entropy`, the pair
        (log-probs, next-token entropies)."""
        from stages.policy.logprobs import shared_prefix_logprobs, token_logprobs, visual_token_logprobs

        if self.vision is not None:
            return visual_token_logprobs(model, self.input_ids, self.attention_mask, self.vision, self.mask, temperature,
                                         entropy=entropy)
        if self.prefix is None:
            return token_logprobs(model, self.input_ids, self.attention_mask, self.mask, temperature, entropy=entropy)
        return shared_prefix_logprobs(model, self.prefix, self.input_ids, self.attention_mask, self.mask, temperature,
                                      entropy=entropy)


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


def _prompt_length(s: Sample) -> int:
    """Tokens before the first sampled one: the prompt the policy continued."""
    return next((t for t, m in enumerate(s.loss_mask) if m), len(s.loss_mask))


def _shared_prompt_batches(samples: list[Sample], size: int, max_tokens: int | None) -> tuple[list[tuple[int, list[int]]], list[int]]:
    """Samples that continue one prompt (a group's G samples), cut into micro-batches of at most `size`
    continuations and `max_tokens` tokens (the prompt once + count x longest continuation):
    ([(prompt length, indices)], indices of samples that share their prompt with no other)."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(samples):
        p = _prompt_length(s)
        if 0 < p < len(s.token_ids):
            by_prompt.setdefault(tuple(s.token_ids[:p]), []).append(i)
    shared, alone = [], [i for i, s in enumerate(samples) if not 0 < _prompt_length(s) < len(s.token_ids)]
    for prompt, idx in by_prompt.items():
        if len(idx) == 1:
            alone += idx
            continue
        P = len(prompt)
        budget = None if max_tokens is None else max(max_tokens - P, 1)
        for chunk in _micro_batch_indices([len(samples[i].token_ids) - P for i in idx], size, budget):
            shared.append((P, [idx[k] for k in chunk]))
    return shared, sorted(alone)


def _micro_batches(samples: list[Sample], size: int, device: Any, max_tokens: int | None = None,
                   share_prompts: bool = False) -> list[_MicroBatch]:
    """Tensors of each micro-batch of `_micro_batch_indices` (right-padded); with `share_prompts`, the samples
    of a shared prompt go in micro-batches of their own that run the prompt once (`_MicroBatch.prefix`)."""
    import torch

    out = []
    alone = list(range(len(samples)))
    # A shared prefix runs the language model alone (`shared_prefix_logprobs`), which cannot take images.
    if share_prompts and all(s.vision is None for s in samples):
        shared, alone = _shared_prompt_batches(samples, size, max_tokens)
        for P, idx in shared:
            S = max(len(samples[i].token_ids) for i in idx) - P
            ids, attn = torch.zeros(len(idx), S, dtype=torch.long), torch.zeros(len(idx), S, dtype=torch.long)
            mask, blp = torch.zeros(len(idx), S, dtype=torch.bool), torch.zeros(len(idx), S)
            for row, i in enumerate(idx):
                s, n = samples[i], len(samples[i].token_ids) - P
                ids[row, :n] = torch.tensor(s.token_ids[P:])
                attn[row, :n] = 1
                mask[row, :n] = torch.tensor(s.loss_mask[P:], dtype=torch.bool)
                blp[row, :n] = torch.tensor(s.behavior_logprobs[P:])
            prefix = torch.tensor(samples[idx[0]].token_ids[:P], device=device)
            out.append(_MicroBatch(torch.tensor(idx), ids.to(device), attn.to(device), mask.to(device), blp.to(device),
                                   prefix=prefix, teacher_logp=_teacher_rows(samples, idx, S, P, device)))
    lengths = [len(samples[i].token_ids) for i in alone]
    for local in _micro_batch_indices(lengths, size, max_tokens):
        idx = [alone[k] for k in local]
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
        vision = _stack_vision([samples[i] for i in idx], device)
        out.append(_MicroBatch(torch.tensor(idx), ids.to(device), attn.to(device), mask.to(device), blp.to(device),
                               vision=vision, teacher_logp=_teacher_rows(samples, idx, T, 0, device)))
    return out


def _teacher_rows(samples: list[Sample], idx: list[int], width: int, skip: int, device: Any) -> Any:
    """(len(idx), width) the samples' teacher log-probs from token `skip` on, right-padded; None without a teacher."""
    import torch

    if samples[idx[0]].teacher_logprobs is None:
        return None
    out = torch.zeros(len(idx), width)
    for row, i in enumerate(idx):
        values = samples[i].teacher_logprobs[skip:]
        out[row, :len(values)] = torch.tensor(values)
    return out.to(device)


def _stack_vision(samples: list[Sample], device: Any) -> Any:
    """The micro-batch's image tensors (stages.policy.vlm.VisionInputs), or None for a text model's samples."""
    if all(s.vision is None for s in samples):
        return None
    from stages.policy.vlm import VisionInputs

    return VisionInputs.stack([s.vision for s in samples]).to(device)


# Per-token stats of the loss, averaged over the batch's scored tokens (stages.update.workers averages the shards').
LOSS_STATS = ("clip_frac_low", "clip_frac_high", "ratio_mean", "kl_mean", "is_weight_mean", "is_masked_frac",
              "entropy", "teacher_kl")


def train_on_batch(model: Any, optimizer: Any, samples: list[Sample], advantages: torch.Tensor,
                   config: GRPOConfig, temperature: float) -> list[dict[str, float]]:
    """`config.epochs` optimizer steps of the GRPO loss on one batch (advantages: (N,), one per
    sample); gradients are accumulated over micro-batches so each step sees the whole batch.
    `temperature` is the one the samples were drawn at (their behaviour log-probs are taken at it).
    Returns one metrics dict per epoch: loss, clip fractions, ratio_mean (1.0 on the first pass
    when the behaviour log-probs came from this model), kl (beta > 0), entropy (the mean next-token entropy at the
    sampled positions), grad_norm, tokens, tokens_per_s.
    """
    import torch

    from stages.policy.logprobs import set_activation_checkpointing
    from stages.update.correction import is_weights
    from stages.update.loss import policy_loss

    if not samples:
        if config.step_without_signal:  # zero gradients: AdamW's momentum alone moves the weights
            params = [p for p in model.parameters() if p.requires_grad]
            for p in params:
                p.grad = torch.zeros_like(p)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return []  # no epoch trained on anything
    device = next(model.parameters()).device
    batches = _micro_batches(samples, config.micro_batch_size, device, config.micro_batch_tokens, config.share_prompts)
    advantages = advantages.float().to(device)
    total_tokens = float(sum(int(b.mask.sum()) for b in batches))
    # dr_grpo's constant normaliser must be the same for every micro-batch: the longest completion.
    max_tokens = max(sum(s.loss_mask) for s in samples)
    if config.beta > 0:  # the reference (adapter off) does not change during the step: score it once
        with torch.no_grad(), model.disable_adapter():
            for b in batches:
                b.ref_logp = b.logprobs(model, temperature)
    params = [p for p in model.parameters() if p.requires_grad]
    _train_without_dropout(model)
    set_activation_checkpointing(model, config.activation_checkpointing)
    history = []
    for _ in range(config.epochs):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        sums = dict.fromkeys(LOSS_STATS, 0.0) | {"loss": 0.0}
        for b in batches:
            _release_free_memory()
            # (b, T) each; the entropy is differentiated only where the loss rewards it
            logp, entropy = b.logprobs(model, temperature, entropy=True if config.entropy_coef > 0 else "detached")
            if b.old_logp is None:  # the first pass runs the weights the step started from
                b.old_logp = logp.detach()
            weight, is_stats = is_weights(b.old_logp, b.behavior_logp, b.mask, config.correction)
            corrected = config.correction.enabled
            adv, teacher_kl = _with_teacher(advantages[b.index.to(device)], b, config)
            loss, stats = policy_loss(logp, b.behavior_logp, adv, b.mask,
                                      eps_low=config.eps_low, eps_high=config.eps_high, ratio_cap=config.ratio_cap,
                                      ref_logp=b.ref_logp, beta=config.beta, aggregation=config.aggregation,
                                      max_tokens=max_tokens, loss_mode=config.loss_mode,
                                      old_logp=b.old_logp if corrected else None, token_weight=weight if corrected else None,
                                      entropy=entropy, entropy_coef=config.entropy_coef)
            stats |= is_stats | {"teacher_kl": teacher_kl}
            # Scale each micro-batch's mean so the accumulated sum is the mean over the whole batch.
            n = stats["num_tokens"]
            weight = n / total_tokens if config.aggregation == "token_mean" else len(b.index) / len(samples)
            (loss * weight).backward()
            sums["loss"] += float(loss.detach()) * weight
            for k in LOSS_STATS:
                sums[k] += stats[k] * n / total_tokens  # token-weighted, like the stats themselves
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm))
        optimizer.step()
        seconds = time.perf_counter() - start
        left_out = {"kl_mean"} | ({"teacher_kl"} if config.distill is None else set())
        metrics = {**{k: v for k, v in sums.items() if k not in left_out},
                   "clip_frac": sums["clip_frac_low"] + sums["clip_frac_high"], "grad_norm": grad_norm,
                   "tokens": total_tokens, "tokens_per_s": total_tokens / seconds}
        if config.beta > 0:
            metrics["kl"] = sums["kl_mean"]
        history.append(metrics)
    return history


def _with_teacher(advantages: torch.Tensor, b: _MicroBatch, config: GRPOConfig) -> tuple[torch.Tensor, float]:
    """The micro-batch's advantages: per sequence (b,), or with a distillation teacher per token (b, T), each sampled
    token's plus coef x (log p_teacher - log p_behaviour); and the mean reverse-KL estimate (behaviour - teacher)."""
    import torch

    if config.distill is None or b.teacher_logp is None:
        return advantages, 0.0
    gap = torch.where(b.mask, b.teacher_logp - b.behavior_logp, torch.zeros((), device=b.mask.device))  # (b, T)
    return advantages[:, None] + config.distill.coef * gap, float(-gap.sum() / b.mask.sum().clamp(min=1))


def _train_without_dropout(model: Any) -> None:
    """Training mode (activation checkpointing only runs in it) with every dropout off: an adapter
    trained by SFT keeps its `lora_dropout`, and a dropout mask in the update's forward pass would make
    the first-pass ratio differ from 1 against behaviour log-probs sampled without it (off-policy)."""
    import torch

    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.eval()


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


def load_base(base_model: str, device: Any, dtype: str | None = None) -> Any:
    """The bare base model an update trains an adapter on, fp32 (or `dtype`, `grpo.dtype`) on `device`: a causal
    LM, or a vision-language model's image-text-to-text model (`stages.policy.vlm.load_vlm_model`, fp32).
    Not stages.policy.load.load_policy: training needs no tokenizer (tokens come from the rollouts),
    and wants fp32 weights on every device unless `grpo.dtype` says otherwise (load_policy picks bf16 on cuda)."""
    import torch
    from transformers import AutoModelForCausalLM

    from stages.policy.vlm import is_vision_language_model, load_vlm_model

    if is_vision_language_model(base_model):
        return load_vlm_model(Path(base_model).expanduser()).to(device)
    with MODEL_LOADING:
        return AutoModelForCausalLM.from_pretrained(resolve_model(base_model),
                                                    dtype=getattr(torch, dtype or "float32")).to(device)


def _load_trainable(base_model: str, adapter_dir: str | None, lora: LoRASettings, dtype: str | None = None) -> Any:
    """A trainable LoRA adapter (`adapter_dir`'s, or a fresh `lora` one) on the base model; peft keeps the adapter's
    weights in fp32 over a bf16 base (its `autocast_adapter_dtype`)."""
    import torch
    from peft import PeftModel

    model = load_base(base_model, "cuda" if torch.cuda.is_available() else "cpu", dtype)
    if adapter_dir is None:
        return add_lora(model, lora)
    with MODEL_LOADING:
        return PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)


def load_for_update(base_model: str, adapter_dir: str | None, config: GRPOConfig) -> tuple[Any, Any]:
    """The trainable policy (a fresh `config.lora` adapter on a bare base model) and its AdamW optimizer,
    continuing the parent step's Adam moments when the parent saved them."""
    model = _load_trainable(base_model, adapter_dir, config.lora, config.dtype)
    return model, make_optimizer(model, adapter_dir, config)


def make_optimizer(model: Any, adapter_dir: str | None, config: GRPOConfig) -> Any:
    """AdamW over `model`'s trainable weights, continuing the Adam moments saved in `adapter_dir` (if any)."""
    import torch

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=config.lr, weight_decay=config.weight_decay)
    parent_opt = Path(adapter_dir) / "optimizer.pt" if adapter_dir else None
    if parent_opt is not None and parent_opt.exists():
        optimizer.load_state_dict(torch.load(parent_opt, map_location="cpu", weights_only=True))
        for group in optimizer.param_groups:  # the saved state carries the parent's lr; this config wins
            group.update(lr=config.lr, weight_decay=config.weight_decay)
    return optimizer


def save_update(folder: Path, model: Any, optimizer: Any, state: dict[str, Any]) -> None:
    """Adapter (safetensors) + optimizer.pt (the next step continues it) + trainer_state.json into `folder`."""
    import torch

    model.save_pretrained(folder, safe_serialization=True)
    torch.save(optimizer.state_dict(), folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps(state, indent=2))
