"""Per-token log-probs of a causal LM, computed only where they are needed.

The output layer is a large share of the work and memory (49k vocab for SmolLM2):
run the decoder body once, then apply the LM head only to the hidden rows whose
next token we score, a chunk of rows at a time, with logsumexp. A full (B, T, V)
float32 tensor is never built (TRL's CPU fallback builds it plus softmax copies).

Assumes logits = lm_head(last_hidden_state), true for Llama/Qwen/SmolLM; models that
post-process logits (Gemma 2 soft-capping, Cohere logit_scale) would need that here too.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


def _causal_lm(model: nn.Module) -> nn.Module:
    """The transformers *ForCausalLM inside a peft PeftModel (LoRA layers stay active), or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def set_activation_checkpointing(model: Any, on: bool) -> None:
    """Turn activation checkpointing of `model` (peft-wrapped or not) on or off; a no-op when it already is.
    Shared by the update (its setting) and by the code that must run a pass without it."""
    lm = _causal_lm(model)
    active = _checkpointing(lm)
    if on and not active:
        enable = getattr(lm, "activation_checkpointing_enable", None) or lm.gradient_checkpointing_enable
        # Non-reentrant: gradients reach the LoRA weights without requiring grad on the inputs.
        enable({"use_reentrant": False})  # first parameter of both: the torch.utils.checkpoint kwargs
        # ...so undo what enabling also did: hook every embedding layer to make its output require grad.
        # For a vision-language model that includes the frozen vision tower's patch embeddings, and the
        # backward pass then ran through the whole vision tower (and kept its activations) for nothing.
        lm.disable_input_require_grads()
    elif not on and active:
        (getattr(lm, "activation_checkpointing_disable", None) or lm.gradient_checkpointing_disable)()


def _checkpointing(lm: nn.Module) -> bool:
    """Whether the causal LM `lm` has activation checkpointing on."""
    # transformers 5 renamed gradient_* to activation_*; the old names still work, with a warning.
    return bool(lm.is_activation_checkpointing if hasattr(lm, "is_activation_checkpointing") else lm.is_gradient_checkpointing)


def _position_ids(attention_mask: Tensor) -> Tensor:  # (B, T)
    # Count only real tokens, as generate() does, so a left-padded row scores like the unpadded one.
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _scored_positions(attention_mask: Tensor, positions_mask: Tensor | None) -> Tensor:  # (B, T) bool
    # Position t is scored from the hidden state at t-1: both must be real tokens, and t >= 1.
    real = attention_mask.bool()
    want = real if positions_mask is None else positions_mask.bool() & real
    want = want.clone()
    want[:, 1:] &= real[:, :-1]
    want[:, 0] = False
    return want


Entropy = bool | Literal["detached"]  # `entropy=`: none, differentiable, or the values only (for logging)


def _chunk_logprobs(lm_head: nn.Module, hidden: Tensor, targets: Tensor, temperature: float,
                    banned: tuple[int, ...] = (), entropy: Entropy = False) -> Tensor:
    logits = lm_head(hidden).float() / temperature  # (n, V), one chunk only
    if banned:  # tokens sampling suppressed (set to -inf, as transformers' SuppressTokensLogitsProcessor does)
        logits = logits.index_fill(-1, torch.tensor(banned, device=logits.device), float("-inf"))
    norm = logits.logsumexp(-1)  # (n,)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - norm  # (n,)
    if not entropy:
        return logp
    # "detached": no backward through the (n, V) softmax below (~10 % of an update's time on SmolLM2 when the loss
    # does not use it).
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy != "detached"):
        # H = logsumexp(z) - sum_v p_v z_v; a banned token (p 0, z -inf) adds 0, not NaN
        finite = logits.masked_fill(~torch.isfinite(logits), 0.0) if banned else logits  # no 0 * -inf, either pass
        expected = ((logits - norm[:, None]).exp() * finite).sum(-1)
        h = norm - expected
    return torch.stack([logp, h], -1)  # (n, 2)


def _scored_logprobs(lm: nn.Module, rows: Tensor, targets: Tensor, temperature: float, chunk_size: int,
                     banned: tuple[int, ...] = (), entropy: Entropy = False) -> Tensor:
    """log p(targets[i] | rows[i]) for hidden states rows (N, H): the output layer a chunk of rows at a
    time; with gradients and the model's activation checkpointing on, each chunk is recomputed in backward,
    so only (chunk_size, V) logits live (off: each chunk's logits are kept for backward, and not computed twice).
    `banned` token ids get probability 0 (what sampling suppressed). `entropy`: (N, 2), each row's
    log-prob and the entropy of its whole next-token distribution (the same logits, no second pass)."""
    lm_head = lm.get_output_embeddings()
    recompute = torch.is_grad_enabled() and _checkpointing(lm)
    chunks = []
    for start in range(0, rows.shape[0], chunk_size):
        args = (lm_head, rows[start : start + chunk_size], targets[start : start + chunk_size], temperature, banned,
                entropy)
        if recompute:
            chunks.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            chunks.append(_chunk_logprobs(*args))
    if chunks:
        return torch.cat(chunks)
    return rows.new_zeros((0, 2) if entropy else 0, dtype=torch.float32)  # (N,) or (N, 2)


def _scatter(want: Tensor, scored: Tensor) -> Tensor | tuple[Tensor, Tensor]:
    """(B, T) zeros holding `scored` (N,) where `want` is True; for (N, 2) scores, two such tensors."""
    def place(values: Tensor) -> Tensor:
        return torch.zeros(want.shape, dtype=torch.float32, device=values.device).masked_scatter(want, values)

    return place(scored) if scored.dim() == 1 else (place(scored[:, 0]), place(scored[:, 1]))


def token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    positions_mask: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 512,
    entropy: Entropy = False,
) -> Any:
    """log p(input_ids[:, t] | input_ids[:, :t]) under logits / temperature, as a float32 (B, T)
    tensor aligned with input_ids; 0 at t = 0, at padding and wherever positions_mask is False
    (e.g. pass the rollout loss_mask to score only sampled tokens). `entropy`: a pair (log-probs,
    entropies), the second the entropy of each scored position's next-token distribution (the same
    logits; what `grpo.entropy_coef` rewards; "detached": its values without a gradient, for logging).
    The same holds for the two variants below.

    Works on a transformers causal LM or a peft-wrapped one (gradients reach the LoRA
    weights). With gradients enabled and the model's activation checkpointing on, each chunk is recomputed
    in backward, so only (chunk_size, V) logits are alive at a time (off: kept, and computed once).
    """
    lm = _causal_lm(model)
    want = _scored_positions(attention_mask, positions_mask)  # (B, T)
    hidden = lm.get_decoder()(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=_position_ids(attention_mask),
        use_cache=False,
    ).last_hidden_state  # (B, T, H)
    return _logprobs_at(lm, hidden, input_ids, want, temperature, chunk_size, entropy=entropy)


def _logprobs_at(lm: nn.Module, hidden: Tensor, input_ids: Tensor, want: Tensor, temperature: float,
                 chunk_size: int, banned: tuple[int, ...] = (), entropy: Entropy = False) -> Any:
    """(B, T) log-probs of input_ids where `want` (B, T) is True, from the decoder's states hidden (B, T, H)
    (with `entropy`, the pair of log-probs and entropies)."""
    rows = hidden[:, :-1][want[:, 1:]]  # (N, H): the state before each scored token
    targets = input_ids[:, 1:][want[:, 1:]]  # (N,)
    scored = _scatter(want[:, 1:], _scored_logprobs(lm, rows, targets, temperature, chunk_size, banned, entropy))
    if isinstance(scored, tuple):
        return tuple(F.pad(x, (1, 0)) for x in scored)  # (B, T) each
    return F.pad(scored, (1, 0))  # (B, T)


def visual_token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    vision: Any,
    positions_mask: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 512,
    entropy: Entropy = False,
) -> Any:
    """`token_logprobs` for a vision-language model (transformers `*ForConditionalGeneration`, peft-wrapped
    or not): the multimodal body (`lm.model`: vision tower, projector, language model) runs on the tokens
    and the image tensors of `vision` (a `stages.policy.vlm.VisionInputs`), and the tokens sampling
    suppressed (`vision.banned_ids`) get probability 0. Rows must be right-padded: the model
    numbers positions itself (Idefics3 from 0, Qwen2-VL by its multimodal rope from the ids, the image
    grids and the attention mask), as when sampling."""
    lm = _causal_lm(model)
    want = _scored_positions(attention_mask, positions_mask)  # (B, T)
    hidden = lm.model(input_ids=input_ids, attention_mask=attention_mask,
                      **vision.model_inputs(input_ids), use_cache=False).last_hidden_state  # (B, T, H)
    return _logprobs_at(lm, hidden, input_ids, want, temperature, chunk_size, vision.banned_ids, entropy)


def shared_prefix_logprobs(
    model: nn.Module,
    prefix: Tensor,
    suffix_ids: Tensor,
    suffix_mask: Tensor,
    positions_mask: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 512,
    entropy: Entropy = False,
) -> Any:
    """log p(suffix_ids[i, t] | prefix, suffix_ids[i, :t]) for n continuations of one shared prefix, as a
    float32 (n, S) tensor, 0 at padding and wherever positions_mask is False: `token_logprobs` of each
    row prefix + suffix_ids[i], with the prefix run once instead of n times.

    The prefix (P,) goes through the decoder once and its key/value cache is repeated for the n rows;
    the suffixes (n, S, right-padded, `suffix_mask` 1 on real tokens) then attend to it. Gradients reach
    the LoRA weights through both passes. Under activation checkpointing the prefix pass runs without it
    (one short sequence) and the suffix layers are checkpointed with the prefix cache read-only
    (`_read_only_prefix`), so their recomputation in backward sees the same keys and values.
    Llama-style decoders (transformers 5: `cache=` from 5.24, `past_key_values=` before); tests compare it
    with `token_logprobs`.
    """
    lm = _causal_lm(model)
    decoder = lm.get_decoder()
    n, S = suffix_ids.shape
    P = prefix.shape[0]
    checkpointing = _checkpointing(lm) and decoder.training and torch.is_grad_enabled()
    if checkpointing:
        set_activation_checkpointing(model, False)
    try:
        head = decoder(input_ids=prefix[None], position_ids=torch.arange(P, device=prefix.device)[None], use_cache=True)
    finally:
        if checkpointing:
            set_activation_checkpointing(model, True)
    cache = head.cache if hasattr(head, "cache") else head.past_key_values  # transformers 5 renamed it
    cache.batch_repeat_interleave(n)  # (1, ...) -> (n, ...), differentiable
    cache.__class__ = _read_only_prefix()
    layers = list(decoder.layers)
    for layer in layers:  # the cache is only read: checkpointed layers may keep it (transformers' own rule)
        layer._can_checkpoint_with_cache = True
    # transformers 5.24 named the argument `cache`; earlier 5.x releases ignore that name (the suffixes then
    # ran without the prefix: a shape error) and take `past_key_values`.
    cache_arg = "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
    try:
        tail = decoder(
            input_ids=suffix_ids,
            attention_mask=torch.cat([suffix_mask.new_ones(n, P), suffix_mask], 1),
            position_ids=(P + torch.arange(S, device=suffix_ids.device))[None].expand(n, -1),
            use_cache=False,
            **{cache_arg: cache},
        ).last_hidden_state  # (n, S, H)
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache
    # Token t of a suffix is scored from the state before it: the prefix's last for t = 0.
    states = torch.cat([head.last_hidden_state[:, -1:].expand(n, 1, -1), tail[:, :-1]], 1)  # (n, S, H)
    want = suffix_mask.bool() if positions_mask is None else suffix_mask.bool() & positions_mask.bool()
    return _scatter(want, _scored_logprobs(lm, states[want], suffix_ids[want], temperature, chunk_size,
                                           entropy=entropy))  # (n, S)


@functools.cache
def _read_only_prefix() -> type:
    """`ReadOnlyPrefix`, a transformers `DynamicCache` subclass (transformers imported on first use)."""
    from transformers import DynamicCache

    class ReadOnlyPrefix(DynamicCache):
        """A prefix's key/value cache that attention reads but never extends: `update` returns the prefix
        followed by the new states without storing them, so a checkpointed layer recomputed in backward
        sees exactly what it saw forward."""

        def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
            layer = self.layers[layer_idx]
            return torch.cat([layer.keys, key_states], -2), torch.cat([layer.values, value_states], -2)

    return ReadOnlyPrefix
