"""Off-policy correction (stages/update/correction.py): TIS, MIS and icepop against hand-computed numbers,
and through `train_on_batch` on a tiny model whose behaviour log-probs disagree with it."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from stages.common import identity
from stages.update.config import GRPOConfig
from stages.update.correction import Correction, is_weights
from stages.update.data import Sample
from stages.update.loss import group_advantages, policy_loss
from stages.update.train import train_on_batch
from tests.stages.test_grpo import LEARN, sample, tiny_setup

# Two sequences; sequence 0 has 3 scored tokens with IS weights w = exp(old - behaviour) = [2, 1, 0.25]
# (old 0, behaviour [-ln 2, 0, ln 4]); sequence 1 has 2 scored tokens with w = [1, 1] and a masked third
# position holding garbage. Sequence 0's geometric-mean weight: exp((ln 2 - ln 4) / 3) = 2^(-1/3) = 0.793701.
OLD = torch.zeros(2, 3)
BEHAVIOR = torch.tensor([[-math.log(2), 0.0, math.log(4)], [0.0, 0.0, float("nan")]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
RAW_MEAN = (2 + 1 + 0.25 + 1 + 1) / 5  # 1.05


@pytest.mark.parametrize(
    "correction, weights, masked",
    [
        (Correction(), [[1, 1, 1], [1, 1, 0]], 0.0),  # nothing on: every scored token weighs 1
        (Correction(tis_cap=1.5), [[1.5, 1, 0.25], [1, 1, 0]], 0.0),  # min(w, 1.5)
        (Correction(icepop_range=(0.5, 1.5)), [[0, 1, 0], [1, 1, 0]], 2 / 5),  # w = 2 and 0.25 dropped
        (Correction(tis_cap=3.0, icepop_range=(0.5, 3.0)), [[2, 1, 0], [1, 1, 0]], 1 / 5),  # icepop as published
        (Correction(mis_range=(0.5, 2.0)), [[1, 1, 1], [1, 1, 0]], 0.0),  # 0.7937 inside: kept whole
        (Correction(mis_range=(0.8, 2.0)), [[0, 0, 0], [1, 1, 0]], 3 / 5),  # 0.7937 < 0.8: sequence 0 dropped
    ],
)
def test_is_weights(correction: Correction, weights: list[list[float]], masked: float) -> None:
    got, stats = is_weights(OLD, BEHAVIOR, MASK, correction)
    torch.testing.assert_close(got, torch.tensor(weights, dtype=torch.float32), atol=1e-6, rtol=0)
    assert stats["is_weight_mean"] == pytest.approx(RAW_MEAN, abs=1e-6)
    assert stats["is_masked_frac"] == pytest.approx(masked, abs=1e-6)


def test_weighted_decoupled_loss() -> None:
    # logp = old, so the ratio to old is 1 (not the ratio to the behaviour log-probs, [2, 1, 0.25]): the PPO
    # term is -A per token, times the TIS weight [1.5, 1, 0.25]; token mean over 3: -(2.75) / 3 = -0.916667,
    # d loss / d logp_t = -w_t A / 3 = [-0.5, -1/3, -1/12].
    logp = torch.zeros(1, 3, requires_grad=True)
    weight, _ = is_weights(OLD[:1], BEHAVIOR[:1], MASK[:1], Correction(tis_cap=1.5))
    loss, stats = policy_loss(logp, BEHAVIOR[:1], torch.tensor([1.0]), MASK[:1], old_logp=OLD[:1], token_weight=weight)
    loss.backward()
    assert loss.item() == pytest.approx(-2.75 / 3, abs=1e-6)
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, -1 / 3, -1 / 12]]), atol=1e-6, rtol=0)
    assert stats["ratio_mean"] == 1.0 and stats["clip_frac_high"] == 0.0
    # without correction the same tokens are clipped against the behaviour policy: 2 > 1.28, gradient 0
    logp.grad = None
    loss, stats = policy_loss(logp, BEHAVIOR[:1], torch.tensor([1.0]), MASK[:1], eps_high=0.28)
    loss.backward()
    assert stats["clip_frac_high"] == pytest.approx(1 / 3)
    assert logp.grad[0, 0].item() == 0.0


def test_correction_validation_and_ids() -> None:
    with pytest.raises(ValidationError, match="low < high"):
        Correction(mis_range=(2.0, 0.5))
    with pytest.raises(ValidationError):
        Correction(tis_cap=0)
    assert "correction" not in identity(GRPOConfig())  # off by default: no existing id changes
    assert identity(GRPOConfig(correction=Correction(tis_cap=2.0)))["correction"]["tis_cap"] == 2.0


def _stale_batch(shift: float) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[Sample], torch.Tensor]:
    """A tiny model and its own samples whose behaviour log-probs are shifted by `shift` (as if another
    policy had sampled them): every scored token's IS weight is exp(-shift)."""
    model, optimizer, prompts = tiny_setup(0)
    samples, rewards, groups = sample(model, prompts, 8, seed=5)
    stale = [Sample(s.token_ids, s.loss_mask, [lp + shift * m for lp, m in zip(s.behavior_logprobs, s.loss_mask)])
             for s in samples]
    return model, optimizer, stale, group_advantages(torch.tensor(rewards), groups)


def test_train_on_batch_reports_and_corrects_the_mismatch() -> None:
    model, optimizer, samples, adv = _stale_batch(-math.log(2))  # the trainer's policy is 2x as likely
    plain = train_on_batch(model, optimizer, samples, adv, LEARN, temperature=1.0)[0]
    assert plain["is_weight_mean"] == pytest.approx(2.0, rel=1e-3)
    assert plain["ratio_mean"] == pytest.approx(2.0, rel=1e-3)  # today's ratio is to the behaviour policy

    model, optimizer, samples, adv = _stale_batch(-math.log(2))
    tis = train_on_batch(model, optimizer, samples, adv, LEARN.model_copy(update={"correction": Correction(tis_cap=1.5)}),
                         temperature=1.0)[0]
    assert tis["is_weight_mean"] == pytest.approx(2.0, rel=1e-3)
    assert tis["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # decoupled: the ratio is to the step's start
    assert tis["clip_frac"] == 0.0 and tis["is_masked_frac"] == 0.0


def test_fully_masked_step_trains_nothing() -> None:
    model, optimizer, samples, adv = _stale_batch(-math.log(2))
    config = LEARN.model_copy(update={"correction": Correction(icepop_range=(0.5, 1.5))})  # w = 2: all dropped
    m = train_on_batch(model, optimizer, samples, adv, config, temperature=1.0)[0]
    assert m["is_masked_frac"] == pytest.approx(1.0)
    assert m["grad_norm"] == 0.0
    # every gradient is exactly 0 (tiny_setup's AdamW still decays the weights, so they are not compared)
    assert all(not p.grad.any() for p in model.parameters() if p.requires_grad)
