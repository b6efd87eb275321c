"""Off-policy correction from the recorded behaviour log-probs: truncated IS (TIS), sequence masking (MIS)
and icepop-style token masking.

Three policies meet in an update whose rollouts were generated elsewhere or earlier (an asynchronous run,
a vLLM sampler): the behaviour policy that sampled the tokens (`behavior_logprobs`, recorded per token),
the trainer's policy at the start of the step ("old", computed on the first pass of the step at no extra
cost), and the policy being trained. With a correction on, the surrogate's ratio is taken against "old"
and the mismatch old / behaviour becomes a per-token weight (decoupled PPO, AReaL, arXiv 2505.24298):

    w_t = exp(old_logp_t - behavior_logp_t)        the importance-sampling weight of token t
    tis_cap C         weight min(w_t, C)            (Yao et al., "Your efficient RL framework secretly
                                                      brings you off-policy RL training", 2025)
    icepop_range a,b  drop tokens with w_t outside [a, b] (IcePop, Ring-1T, arXiv 2510.18855)
    mis_range lo,hi   drop whole sequences whose geometric-mean weight exp(mean_t log w_t) is outside
                      [lo, hi] (masked IS, Liu et al. "When speed kills stability", 2025)

As in verl's rollout correction, the weight (TIS) and the masks (MIS, icepop) are separate knobs: with
masks alone the kept tokens weigh 1. A dropped token keeps its place in the token-mean's denominator
(its loss is 0, the others' weights do not grow). MIS uses the geometric mean rather than the product
of the token weights so that one threshold means the same for a 20-token answer and a 400-token episode.
All off (the default) is today's objective: the ratio against the behaviour log-probs, unweighted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, field_validator

if TYPE_CHECKING:
    from torch import Tensor


class Correction(BaseModel):
    """Which corrections the GRPO update applies (all off by default: the plain ratio to the behaviour policy)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tis_cap: float | None = Field(None, gt=0)  # verl's and Yao et al.'s usual C = 2
    mis_range: tuple[float, float] | None = None  # e.g. (0.5, 2.0)
    icepop_range: tuple[float, float] | None = None  # IcePop's (0.5, 5.0)

    @field_validator("mis_range", "icepop_range")
    @classmethod
    def _range(cls, v: tuple[float, float] | None) -> tuple[float, float] | None:
        if v is not None and not 0 <= v[0] < v[1]:
            raise ValueError(f"a range needs 0 <= low < high, got {list(v)}")
        return v

    @property
    def enabled(self) -> bool:
        return self.tis_cap is not None or self.mis_range is not None or self.icepop_range is not None


def is_weights(old_logp: Tensor, behavior_logp: Tensor, mask: Tensor, correction: Correction) -> tuple[Tensor, dict[str, float]]:
    """The per-token weight (B, T) the loss multiplies by (0 where masked or dropped; no gradient) and the
    stats: `is_weight_mean` (mean raw w_t over the scored tokens: 1.0 when generation and training agree)
    and `is_masked_frac` (share of scored tokens dropped by MIS or icepop). old_logp, behavior_logp, mask: (B, T)."""
    import torch

    mask = mask.bool()
    zero = torch.zeros((), dtype=old_logp.dtype, device=old_logp.device)
    # torch.where, not "* mask": padding may hold inf/NaN, and 0 * inf = NaN.
    log_w = torch.where(mask, old_logp.detach() - behavior_logp.to(old_logp.dtype), zero)  # (B, T)
    w = log_w.exp()
    keep = mask
    if correction.icepop_range is not None:
        lo, hi = correction.icepop_range
        keep = keep & (w >= lo) & (w <= hi)
    if correction.mis_range is not None:
        lo, hi = correction.mis_range
        seq = (log_w.sum(-1) / mask.sum(-1).clamp(min=1)).exp()  # (B,) geometric mean of w over the sequence
        keep = keep & ((seq >= lo) & (seq <= hi))[:, None]
    applied = w.clamp(max=correction.tis_cap) if correction.tis_cap is not None else torch.ones_like(w)
    n = mask.sum().clamp(min=1)
    stats = {"is_weight_mean": float(torch.where(mask, w, zero).sum() / n),
             "is_masked_frac": float((mask & ~keep).sum() / n)}
    return torch.where(keep, applied, zero), stats
