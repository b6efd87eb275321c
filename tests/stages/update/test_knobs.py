"""The training knobs of stages/update (issue 55): the entropy bonus and DAPO's overlong filtering, against
numbers worked out by hand or computed another way (the soft overlong penalty: tests/rewards/test_builtin_rewards.py)."""

from __future__ import annotations

import json

import pytest
import torch

from stages.update.config import GRPOConfig
from stages.update.data import training_data
from stages.update.loss import group_advantages, policy_loss


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    return torch.distributions.Categorical(logits=logits).entropy()


def test_token_logprobs_reports_each_positions_entropy(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    from stages.policy.logprobs import shared_prefix_logprobs, token_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    attn, mask = torch.ones_like(ids), torch.tensor([[0, 0, 1, 1, 1, 1]])
    with torch.no_grad():
        logp, entropy = token_logprobs(model, ids, attn, mask, temperature=0.7, entropy=True)
        logits = model(input_ids=ids).logits[0, :-1] / 0.7  # position t is scored from t - 1
        plain = token_logprobs(model, ids, attn, mask, temperature=0.7)
        _, shared = shared_prefix_logprobs(model, ids[0, :2], ids[:, 2:], attn[:, 2:], mask[:, 2:], 0.7, entropy=True)
    assert torch.equal(logp, plain)  # the log-probs are the same numbers with or without the entropy
    expected = _entropy(logits)[1:]  # positions 2..5
    assert torch.allclose(entropy[0, 2:], expected, atol=1e-4) and (entropy[0, :2] == 0).all()
    assert torch.allclose(shared[0], expected, atol=1e-4)


def test_the_entropy_bonus_raises_the_entropy_and_is_off_by_default() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 11, requires_grad=True)  # (B, T, V): a policy's distribution at 3 positions
    targets, mask = torch.randint(0, 11, (2, 3)), torch.ones(2, 3)

    def step(coef: float) -> tuple[float, float, float]:
        logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
        loss, stats = policy_loss(logp, logp.detach(), torch.zeros(2), mask, entropy=_entropy(logits),
                                  entropy_coef=coef)
        grad, = torch.autograd.grad(loss, logits)
        after = _entropy(logits.detach() - 10.0 * grad).mean()  # one plain gradient step
        return stats["entropy"], float(after), float(grad.abs().sum())

    before, after, grad = step(0.1)
    assert before == pytest.approx(float(_entropy(logits.detach()).mean()), abs=1e-6)
    assert after > before + 1e-3  # gradient descent on -coef * H climbs the entropy
    assert step(0.0)[2] == 0.0  # zero advantages and no bonus: nothing moves
    assert GRPOConfig().entropy_coef == 0.0
    with pytest.raises(ValueError, match="entropy_coef > 0 needs entropy"):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2), entropy_coef=0.1)


def _row(group: str, value: float, truncated: bool) -> dict:
    return {"rollout_id": f"r{group}{value}{truncated}", "batch_id": "b", "group_id": group, "value": value,
            "token_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1], "behavior_logprobs": [0.0, -1.0, -1.0, -1.0],
            "segment_starts": None, "sampling": json.dumps({"temperature": 1.0}), "truncated": truncated}


def test_masked_truncated_rollouts_count_in_their_group_but_train_nothing() -> None:
    rows = [_row("g", 1.0, False), _row("g", 0.0, True), _row("g", 0.0, False), _row("g", 0.5, True)]
    everything = training_data(rows, "group", "mean")
    masked = training_data(rows, "group", "mean", mask_truncated=True)
    assert len(everything.samples) == 4 and len(masked.samples) == 2
    assert masked.metrics["masked_truncated"] == 2.0 and everything.metrics["masked_truncated"] == 0.0
    # the baseline and scale still see all four rewards: the kept samples keep their advantages
    full = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.5]), ["g"] * 4)
    assert torch.allclose(masked.advantages, full[[0, 2]])
    assert torch.allclose(everything.advantages, full)
