"""PPO's credit assignment: GAE over a rollout's steps, a step being a policy token or an assistant turn.

Pure functions, tested against hand-computed numbers. The outcome reward arrives at the last step; the
value of a step is the critic's estimate of the return before that step is taken.

    turn_spans([0, 0, 1, 1, 0, 1])                    # [(2, 4), (5, 6)]: two assistant turns
    adv, ret = gae([0.0, 1.0], [0.4, 0.7], gamma=1.0, lam=0.95)
    per_token = spread(adv, turn_spans(mask), len(mask))   # every token of turn k gets turn k's advantage

Per-token credit (`credit="token"`, the usual PPO for LLMs) makes every sampled token a step. Per-turn
credit (`credit="turn"`) makes each assistant turn one step, with the value at each turn boundary, so a
multi-turn episode's credit is given per turn: a turn after which the critic thinks success became likely
gets a positive advantage even if the episode failed later (verl #7244, prime-rl #3282 ask for this).
"""

from __future__ import annotations

import torch
from torch import Tensor

from stages.update.config import Credit


def turn_spans(loss_mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of sampled tokens (mask 1): the assistant turns of a rollout."""
    spans, start = [], None
    for t, m in enumerate(loss_mask):
        if m and start is None:
            start = t
        elif not m and start is not None:
            spans.append((start, t))
            start = None
    if start is not None:
        spans.append((start, len(loss_mask)))
    return spans


def step_positions(loss_mask: list[int], credit: Credit) -> list[int]:
    """The token positions that are steps: every sampled token, or the first token of each turn. The
    critic's value of step at position t is read from the hidden state at t - 1 (the state before it)."""
    if credit == "token":
        return [t for t, m in enumerate(loss_mask) if m]
    return [a for a, _ in turn_spans(loss_mask)]


def gae(rewards: list[float] | Tensor, values: list[float] | Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al., arXiv 1506.02438) over one episode's steps
    (S,): delta_t = r_t + gamma V_{t+1} - V_t (V after the last step = 0, the episode ended),
    A_t = delta_t + gamma lam A_{t+1}. Returns (advantages (S,), returns = advantages + values (S,))."""
    r = torch.as_tensor(rewards, dtype=torch.float32)
    v = torch.as_tensor(values, dtype=torch.float32)
    adv = torch.zeros_like(r)
    running = torch.zeros(())
    for t in reversed(range(len(r))):
        next_value = v[t + 1] if t + 1 < len(v) else torch.zeros(())
        running = r[t] + gamma * next_value - v[t] + gamma * lam * running
        adv[t] = running
    return adv, adv + v


def spread(step_values: Tensor, loss_mask: list[int], credit: Credit) -> Tensor:
    """Per-step values (S,) -> per-token (T,): each sampled token takes its step's value (its own, or its
    turn's), other tokens 0."""
    out = torch.zeros(len(loss_mask), dtype=step_values.dtype)
    if credit == "token":
        out[torch.tensor([t for t, m in enumerate(loss_mask) if m], dtype=torch.long)] = step_values
        return out
    for k, (a, b) in enumerate(turn_spans(loss_mask)):
        out[a:b] = step_values[k]
    return out


def episode_advantages(reward: float, values: Tensor, loss_mask: list[int], credit: Credit, gamma: float,
                       lam: float) -> tuple[Tensor, Tensor]:
    """One episode: the outcome `reward` at its last step, the critic's `values` (S,) at its steps ->
    (per-token advantages (T,), per-step returns (S,), the value targets)."""
    rewards = torch.zeros(len(values))
    rewards[-1] = reward
    adv, ret = gae(rewards, values, gamma, lam)
    return spread(adv, loss_mask, credit), ret


def clipped_token_loss(logp: Tensor, behavior_logp: Tensor, advantages: Tensor, mask: Tensor, eps: float) -> Tensor:
    """PPO's clipped surrogate (arXiv 1707.06347) with an advantage per token: logp, behavior_logp,
    advantages, mask (B, T); the token mean over the mask."""
    mask = mask.bool()
    zero = torch.zeros((), dtype=logp.dtype)
    ratio = torch.where(mask, logp - behavior_logp.to(logp.dtype), zero).exp()
    per_token = -torch.min(ratio * advantages, ratio.clamp(1 - eps, 1 + eps) * advantages)
    return torch.where(mask, per_token, zero).sum() / mask.sum().clamp(min=1)
