"""The GRPO objective: group advantages, clipped surrogate, k3 KL, loss aggregation.

Pure tensor functions (no I/O, no model code), so every option can be checked
against hand-computed numbers. Shapes: N rollouts, B sequences, T tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Literal

import torch
from torch import Tensor

Scale = Literal["group", "batch", "none"]
Baseline = Literal["mean", "rloo", "batch"]
Aggregation = Literal["token_mean", "seq_mean", "dr_grpo"]
LossMode = Literal["ppo_clip", "gspo", "cispo"]


def _group_index(group_ids: Tensor | Sequence[Hashable]) -> Tensor:
    """Map arbitrary group ids (ints, strings) to 0..G-1, in order of first appearance."""
    ids = group_ids.tolist() if isinstance(group_ids, Tensor) else list(group_ids)
    first: dict[Hashable, int] = {}
    return torch.tensor([first.setdefault(g, len(first)) for g in ids], dtype=torch.long)


def _group_sum(x: Tensor, index: Tensor) -> Tensor:  # (N,) -> (G,)
    return torch.zeros(int(index.max()) + 1, dtype=x.dtype, device=x.device).index_add_(0, index, x)


# Baselines subtracted from each reward; each takes (rewards (N,), group index (N,)) -> (N,).
def _mean_baseline(r: Tensor, g: Tensor) -> Tensor:
    # GRPO, https://arxiv.org/abs/2402.03300 (DeepSeekMath, sec. 4.1.2)
    return (_group_sum(r, g) / _group_sum(torch.ones_like(r), g))[g]


def _rloo_baseline(r: Tensor, g: Tensor) -> Tensor:
    # RLOO, https://arxiv.org/abs/2402.14740: mean of the OTHER members; a singleton group gets advantage 0.
    others = _group_sum(torch.ones_like(r), g)[g] - 1
    return torch.where(others > 0, (_group_sum(r, g)[g] - r) / others.clamp(min=1), r)


def _batch_baseline(r: Tensor, g: Tensor) -> Tensor:
    # REINFORCE++, https://arxiv.org/abs/2501.03262: the whole batch's mean (global normalisation, no groups).
    return r.mean().expand_as(r)


BASELINES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"mean": _mean_baseline, "rloo": _rloo_baseline,
                                                            "batch": _batch_baseline}


def _group_std(r: Tensor, g: Tensor) -> Tensor:  # (N,): population std of each member's group
    return _mean_baseline((r - _mean_baseline(r, g)) ** 2, g).sqrt()


# Divisors of the centred reward (population std, unbiased=False); each takes (rewards, group index, eps) -> (N,).
SCALES: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {
    # GRPO: per-group std, https://arxiv.org/abs/2402.03300
    "group": lambda r, g, eps: _group_std(r, g) + eps,
    # batch std, https://arxiv.org/abs/2508.08221 ("Tricks or Traps", group mean + batch std)
    "batch": lambda r, g, eps: (r.std(unbiased=False) + eps).expand_as(r),
    # Dr. GRPO drops the std (it biases toward too-easy/too-hard prompts), https://arxiv.org/abs/2503.20783
    "none": lambda r, g, eps: torch.ones_like(r),
}


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor | Sequence[Hashable],
    scale: Scale = "group",
    baseline: Baseline = "mean",
    eps: float = 1e-6,
) -> Tensor:
    """Advantage of each rollout (N,): (reward - group baseline) / scale, where scale is
    the group's or the batch's population std (+ eps), or 1 for "none" (Dr. GRPO)."""
    rewards = rewards.float()
    g = _group_index(group_ids).to(rewards.device)
    return (rewards - BASELINES[baseline](rewards, g)) / SCALES[scale](rewards, g, eps)


def zero_variance_groups(rewards: Tensor, group_ids: Tensor | Sequence[Hashable]) -> Tensor:
    """Bool (N,): True for members of groups whose rewards all agree (incl. singletons): no signal."""
    g = _group_index(group_ids).to(rewards.device)
    empty = torch.zeros(int(g.max()) + 1, dtype=rewards.dtype, device=rewards.device)
    hi = empty.scatter_reduce(0, g, rewards, "amax", include_self=False)
    lo = empty.scatter_reduce(0, g, rewards, "amin", include_self=False)
    return (hi == lo)[g]


# Aggregations of the per-token loss x (B, T), already zero at masked positions.
AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, int], Tensor]] = {
    # DAPO token-level mean over all tokens of the batch, https://arxiv.org/abs/2503.14476
    "token_mean": lambda x, m, max_tokens: x.sum() / m.sum().clamp(min=1),
    # original GRPO: mean over sequences of each sequence's token mean, https://arxiv.org/abs/2402.03300
    "seq_mean": lambda x, m, max_tokens: (x.sum(-1) / m.sum(-1).clamp(min=1)).mean(),
    # Dr. GRPO: a constant normaliser B * max_tokens, no length bias, https://arxiv.org/abs/2503.20783
    "dr_grpo": lambda x, m, max_tokens: x.sum() / (x.shape[0] * max_tokens),
}


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 >= 0.
    Schulman, http://joschu.net/blog/kl-approx.html"""
    log_ratio = ref_logp - logp
    return log_ratio.exp() - log_ratio - 1


# Per-token surrogates: each takes (logp, log_ratio, mask, adv) with logp, log_ratio, mask: (B, T) (zero at
# masked positions) and adv: (B, 1), and returns (per-token loss (B, T), the ratio the clip saw (B, T)).
def ppo_clip(logp: Tensor, log_ratio: Tensor, mask: Tensor, adv: Tensor, *, eps_low: float, eps_high: float,
             ratio_cap: float | None) -> tuple[Tensor, Tensor]:
    """PPO's clipped surrogate, https://arxiv.org/abs/1707.06347: -min(r A, clip(r, 1-eps_low, 1+eps_high) A),
    with r capped at ratio_cap (dual-clip, https://arxiv.org/abs/1912.09729)."""
    ratio = log_ratio.exp()
    if ratio_cap is not None:
        ratio = ratio.clamp(max=ratio_cap)
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    return -torch.min(ratio * adv, clipped * adv), ratio


def gspo(logp: Tensor, log_ratio: Tensor, mask: Tensor, adv: Tensor, *, eps_low: float, eps_high: float,
         ratio_cap: float | None) -> tuple[Tensor, Tensor]:
    """GSPO, https://arxiv.org/abs/2507.18071: the clip acts on the sequence ratio s = exp(mean_t log r_t),
    the same for every token of a sequence. Written in the paper's GSPO-token form (eq. 13),
    s_t = sg(s) * pi(y_t) / sg(pi(y_t)): its value is s and d s_t / d logp_t = s, so with seq_mean
    aggregation the gradient is exactly GSPO's (1/|y|) s A sum_t grad logp_t, and a clipped sequence trains
    nothing. The paper's clip range is far narrower than PPO's (eps ~ 3e-4 / 4e-4)."""
    seq = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
    return ppo_clip(logp, seq.detach() + logp - logp.detach(), mask, adv, eps_low=eps_low, eps_high=eps_high,
                    ratio_cap=ratio_cap)


def cispo(logp: Tensor, log_ratio: Tensor, mask: Tensor, adv: Tensor, *, eps_low: float, eps_high: float,
          ratio_cap: float | None) -> tuple[Tensor, Tensor]:
    """CISPO, https://arxiv.org/abs/2506.13585 (MiniMax-M1, eq. 4): -sg(clip(r, 1-eps_low, 1+eps_high)) A logp.
    The IS weight is clipped and stop-gradient, so every token keeps a gradient (PPO's clip drops it);
    ratio_cap has nothing left to bound. MiniMax sets no lower bound and a wide upper one (eps_high)."""
    weight = log_ratio.exp().clamp(1 - eps_low, 1 + eps_high).detach()
    return -weight * adv * logp, log_ratio.exp()


SURROGATES: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {"ppo_clip": ppo_clip, "gspo": gspo, "cispo": cispo}


def policy_loss(
    logp: Tensor,
    behavior_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    ratio_cap: float | None = None,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    aggregation: Aggregation = "token_mean",
    max_tokens: int | None = None,
    loss_mode: LossMode = "ppo_clip",
    old_logp: Tensor | None = None,
    token_weight: Tensor | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """The GRPO objective: a surrogate (`loss_mode`: `ppo_clip`, `gspo` or `cispo`, see `SURROGATES`) plus beta * k3 KL.

    logp, behavior_logp, ref_logp, mask: (B, T); advantages: (B,), or (B, T) per token. eps_high > eps_low is
    DAPO's clip-higher. ratio_cap truncates the ratio from above; with ratio_cap > 1 + eps_high
    that is dual-clip (https://arxiv.org/abs/1912.09729): a negative-advantage token's loss is
    bounded by ratio_cap * |A| and stops pushing. max_tokens is dr_grpo's constant normaliser
    (the generation budget; defaults to T). Off-policy correction (stages/update/correction.py): with
    old_logp (B, T) the ratio is taken against it instead of behavior_logp, and token_weight (B, T), the
    truncated/masked IS weight old / behaviour, multiplies each token's surrogate (decoupled PPO, not the
    KL term). `entropy` (B, T): the policy's next-token entropy at each position (`token_logprobs(...,
    entropy=True)`); entropy_coef > 0 subtracts entropy_coef x entropy from each token's loss (an entropy
    bonus, aggregated like the surrogate), and its mean is reported as `entropy` either way.
    Masked positions never contribute, whatever they
    hold (inf/NaN included). Returns (scalar loss, stats as python floats).
    """
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp")
    if entropy_coef > 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs entropy")
    mask = mask.bool()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    # torch.where, not "* mask": 0 * inf = NaN, in the forward and in the gradient.
    logp = torch.where(mask, logp, zero)
    behavior_logp = torch.where(mask, behavior_logp.to(logp.dtype), zero)
    adv = advantages.to(logp.dtype)
    adv = adv[:, None] if adv.dim() == 1 else adv  # (B, 1), or (B, T) per token (a distillation teacher's)

    anchor = behavior_logp if old_logp is None else torch.where(mask, old_logp.detach().to(logp.dtype), zero)
    per_token, ratio = SURROGATES[loss_mode](logp, logp - anchor, mask, adv, eps_low=eps_low,
                                            eps_high=eps_high, ratio_cap=ratio_cap)  # (B, T) each
    if token_weight is not None:
        per_token = per_token * torch.where(mask, token_weight.detach().to(logp.dtype), zero)
    kl = k3_kl(logp, torch.where(mask, ref_logp.to(logp.dtype), zero)) if ref_logp is not None else None
    if kl is not None and beta > 0:
        per_token = per_token + beta * kl
    if entropy is not None:
        entropy = torch.where(mask, entropy.to(logp.dtype), zero)
        if entropy_coef > 0:
            per_token = per_token - entropy_coef * entropy
    per_token = torch.where(mask, per_token, zero)
    loss = AGGREGATIONS[aggregation](per_token, mask, max_tokens or mask.shape[1])

    n = mask.sum().clamp(min=1)
    with torch.no_grad():
        stats = {
            # tokens whose gradient the clip removed, on each side
            "clip_frac_low": float(((ratio < 1 - eps_low) & (adv < 0) & mask).sum() / n),
            "clip_frac_high": float(((ratio > 1 + eps_high) & (adv > 0) & mask).sum() / n),
            "ratio_mean": float(torch.where(mask, ratio, zero).sum() / n),
            "kl_mean": float(torch.where(mask, kl, zero).sum() / n) if kl is not None else 0.0,
            "entropy": float(entropy.sum() / n) if entropy is not None else 0.0,
            "num_tokens": float(mask.sum()),
        }
    return loss, stats
