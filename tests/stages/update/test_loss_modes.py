"""GSPO and CISPO (stages/update/loss.py SURROGATES) against hand-computed numbers (worked out in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from stages.common import identity
from stages.update.config import GRPOConfig
from stages.update.loss import policy_loss


def _grads(log_ratios: list[float], adv: float, mask: list[int] | None = None, **kw: object) -> tuple[float, list[float]]:
    """Loss and d loss / d logp per token of one sequence with behavior_logp 0 (so logp is the log-ratio)."""
    logp = torch.tensor([log_ratios], requires_grad=True)
    m = torch.tensor([mask or [1] * len(log_ratios)])
    loss, _ = policy_loss(logp, torch.zeros_like(logp), torch.tensor([adv]), m, **kw)
    loss.backward()
    return loss.item(), logp.grad[0].tolist()


# Token ratios [1.5, 1.0]: the sequence ratio is s = exp((ln 1.5 + 0) / 2) = sqrt(1.5) = 1.224745.
# PPO clips token 0 alone (1.5 > 1.28); GSPO sees only s, inside [0.8, 1.28], so both tokens train:
# loss = -s A (token mean of two equal terms); d loss / d logp_t = -s A / 2 = -0.612372 for EACH token.
def test_gspo_uses_the_sequence_ratio() -> None:
    s = math.sqrt(1.5)
    loss, grad = _grads([math.log(1.5), 0.0], adv=1.0, loss_mode="gspo", eps_high=0.28)
    assert loss == pytest.approx(-s, abs=1e-6)
    assert grad == pytest.approx([-s / 2, -s / 2], abs=1e-6)
    # the token-level clip on the same numbers: token 0 clipped at 1.28 (no gradient), token 1 at r = 1
    loss, grad = _grads([math.log(1.5), 0.0], adv=1.0, eps_high=0.28)
    assert loss == pytest.approx(-(1.28 + 1.0) / 2, abs=1e-6)
    assert grad == pytest.approx([0.0, -0.5], abs=1e-6)


def test_gspo_clips_whole_sequences() -> None:
    # s = 1.224745 > 1 + 0.2 with A > 0: the sequence is clipped, loss -1.2, and no token trains
    loss, grad = _grads([math.log(1.5), 0.0], adv=1.0, loss_mode="gspo", eps_high=0.2)
    assert loss == pytest.approx(-1.2, abs=1e-6)
    assert grad == [0.0, 0.0]


def test_gspo_ignores_masked_tokens() -> None:
    # the masked third token (ratio e^5) is not part of s: the same numbers as two tokens
    s = math.sqrt(1.5)
    loss, grad = _grads([math.log(1.5), 0.0, 5.0], adv=1.0, mask=[1, 1, 0], loss_mode="gspo", eps_high=0.28)
    assert loss == pytest.approx(-s, abs=1e-6)
    assert grad == pytest.approx([-s / 2, -s / 2, 0.0], abs=1e-6)


def test_gspo_seq_mean_is_the_papers_objective() -> None:
    # Two sequences of lengths 2 and 1 with s_0 = sqrt(1.5 * 0.9) = 1.161895 and s_1 = 0.9, A = (1, -1):
    # J = -(1/2) (s_0 A_0 + s_1 A_1) = -(1.161895 - 0.9) / 2 = -0.130948; d/dlogp_{0,t} = -(1/2) s_0 / 2.
    logp = torch.tensor([[math.log(1.5), math.log(0.9)], [math.log(0.9), 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, _ = policy_loss(logp, torch.zeros(2, 2), torch.tensor([1.0, -1.0]), mask, loss_mode="gspo",
                          eps_low=0.5, eps_high=0.5, aggregation="seq_mean")
    loss.backward()
    s0 = math.sqrt(1.5 * 0.9)
    assert loss.item() == pytest.approx(-(s0 - 0.9) / 2, abs=1e-6)
    torch.testing.assert_close(logp.grad, torch.tensor([[-s0 / 4, -s0 / 4], [0.9 / 2, 0.0]]), atol=1e-6, rtol=0)


# CISPO: loss = -sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp, so d loss / d logp = -w A, never 0.
@pytest.mark.parametrize(
    "ratio, adv, kw, loss, grad",
    [
        (1.1, 1.0, {}, -1.1 * math.log(1.1), -1.1),  # inside the range: PPO's gradient, -r A
        (1.5, 1.0, {}, -1.2 * math.log(1.5), -1.2),  # clipped weight 1.2, yet a gradient (PPO: 0)
        (1.5, 1.0, {"eps_high": 4.0}, -1.5 * math.log(1.5), -1.5),  # a wide upper bound as MiniMax-M1
        (0.5, -1.0, {}, 0.8 * math.log(0.5), 0.8),  # weight clipped up to 0.8
        (3.0, -1.0, {"ratio_cap": 2.0}, 1.2 * math.log(3.0), 1.2),  # ratio_cap is moot: the clip bounds w
    ],
)
def test_cispo(ratio: float, adv: float, kw: dict[str, float], loss: float, grad: float) -> None:
    got_loss, got_grad = _grads([math.log(ratio)], adv, loss_mode="cispo", **kw)
    assert got_loss == pytest.approx(loss, abs=1e-6)
    assert got_grad == pytest.approx([grad], abs=1e-6)


def test_loss_modes_are_finite_with_masked_garbage() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    logp = torch.tensor([[-0.5, -1.0, float("nan")], [-0.2, float("inf"), float("-inf")]], requires_grad=True)
    for mode in ("gspo", "cispo"):
        loss, _ = policy_loss(logp, torch.full((2, 3), -0.7), torch.tensor([1.0, -1.0]), mask, loss_mode=mode)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
        logp.grad = None


def test_loss_mode_default_keeps_ids() -> None:
    assert "loss_mode" not in identity(GRPOConfig())  # existing checkpoint ids do not change
    assert identity(GRPOConfig(loss_mode="cispo"))["loss_mode"] == "cispo"
