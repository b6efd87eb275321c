"""The GRPO objective against hand-computed numbers (worked out in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from stages.update.loss import group_advantages, k3_kl, policy_loss, zero_variance_groups

# rewards [1, 3 | 0, 4, 8] in groups a, b.
# group a: mean 2, population std 1.   group b: mean 4, deviations -4, 0, 4, var 32/3, std 3.265986.
# batch: mean 3.2, squared deviations 4.84 + 0.04 + 10.24 + 0.64 + 23.04 = 38.8, var 7.76, std 2.785678.
# rloo baselines (mean of the others): a: 3, 1;  b: (4+8)/2 = 6, (0+8)/2 = 4, (0+4)/2 = 2.
REWARDS = [1.0, 3.0, 0.0, 4.0, 8.0]
GROUPS = ["a", "a", "b", "b", "b"]
B_STD = math.sqrt(32 / 3)
BATCH_STD = math.sqrt(7.76)


@pytest.mark.parametrize(
    "scale, baseline, expected",
    [
        ("none", "mean", [-1, 1, -4, 0, 4]),
        ("group", "mean", [-1, 1, -4 / B_STD, 0, 4 / B_STD]),  # -4 / 3.265986 = -1.224745
        ("batch", "mean", [-1 / BATCH_STD, 1 / BATCH_STD, -4 / BATCH_STD, 0, 4 / BATCH_STD]),  # 1/2.785678 = 0.358979
        ("none", "rloo", [1 - 3, 3 - 1, 0 - 6, 4 - 4, 8 - 2]),
        ("group", "rloo", [-2, 2, -6 / B_STD, 0, 6 / B_STD]),  # 6 / 3.265986 = 1.837117
        # REINFORCE++: batch mean 3.2 and batch std, whatever the groups
        ("batch", "batch", [(r - 3.2) / BATCH_STD for r in REWARDS]),  # (1 - 3.2) / 2.785678 = -0.789754
        ("none", "batch", [r - 3.2 for r in REWARDS]),
    ],
)
def test_group_advantages(scale: str, baseline: str, expected: list[float]) -> None:
    adv = group_advantages(torch.tensor(REWARDS), GROUPS, scale=scale, baseline=baseline)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float32), atol=1e-5, rtol=0)


def test_group_ids_as_tensor_match_list() -> None:
    as_tensor = group_advantages(torch.tensor(REWARDS), torch.tensor([7, 7, 3, 3, 3]))
    torch.testing.assert_close(as_tensor, group_advantages(torch.tensor(REWARDS), GROUPS))


def test_rloo_singleton_group_gets_zero() -> None:
    # the lone member of group 1 has no "others": advantage 0, not NaN
    adv = group_advantages(torch.tensor([1.0, 2.0, 5.0]), [0, 0, 1], scale="none", baseline="rloo")
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, 0.0]))


def test_zero_variance_groups() -> None:
    rewards = torch.tensor([1.0, 1.0, 0.0, 2.0, 5.0, 5.0, 3.0])
    flags = zero_variance_groups(rewards, [0, 0, 1, 1, 2, 2, 3])
    assert flags.tolist() == [True, True, False, False, True, True, True]  # group 3 is a singleton
    # and their advantages are 0 (std + eps in the denominator, no NaN)
    assert group_advantages(rewards, [0, 0, 1, 1, 2, 2, 3])[flags].abs().max() == 0


def _one_token(ratio: float, adv: float, **kw: float) -> tuple[float, float, dict[str, float]]:
    """Loss and d loss / d logp for one token with behavior_logp 0, so exp(logp) is the ratio."""
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, stats = policy_loss(logp, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1), **kw)
    loss.backward()
    return loss.item(), logp.grad.item(), stats


# loss = -min(r*A, clip(r)*A); where the unclipped term wins, d loss / d logp = -r*A (dr/dlogp = r),
# where the clipped (constant) term wins the gradient is 0.
@pytest.mark.parametrize(
    "ratio, adv, kw, loss, grad",
    [
        (1.1, 1.0, {}, -1.1, -1.1),  # inside the trust region
        (1.5, 1.0, {}, -1.2, 0.0),  # A > 0, r > 1 + 0.2: clipped high, min(1.5, 1.2)
        (1.5, 1.0, {"eps_high": 0.28}, -1.28, 0.0),  # still clipped, at the higher bound 1.28
        (1.25, 1.0, {"eps_high": 0.28}, -1.25, -1.25),  # clip-higher lets 1.25 through (DAPO)
        (0.5, -1.0, {}, 0.8, 0.0),  # A < 0, r < 1 - 0.2: clipped low, -min(-0.5, -0.8)
        (0.5, -1.0, {"eps_low": 0.6}, 0.5, 0.5),  # r = 0.5 is inside [0.4, 1.2]: -(-0.5)
        (0.5, 1.0, {}, -0.5, -0.5),  # A > 0, r low: the pessimistic min keeps the gradient
        (1.5, -1.0, {}, 1.5, 1.5),  # A < 0, r high: unbounded without a cap, -min(-1.5, -1.2)
        (3.0, -1.0, {}, 3.0, 3.0),
        (3.0, -1.0, {"ratio_cap": 2.0}, 2.0, 0.0),  # dual-clip: r capped at 2, -min(-2, -1.2), no gradient
        (3.0, 1.0, {"ratio_cap": 2.0}, -1.2, 0.0),  # the cap changes nothing for A > 0
        (0.9, -2.0, {}, 1.8, 1.8),  # -min(-1.8, -1.8)
    ],
)
def test_clipped_surrogate(ratio: float, adv: float, kw: dict[str, float], loss: float, grad: float) -> None:
    got_loss, got_grad, _ = _one_token(ratio, adv, **kw)
    assert got_loss == pytest.approx(loss, abs=1e-6)
    assert got_grad == pytest.approx(grad, abs=1e-6)


def test_clip_fraction_stats() -> None:
    # tokens: (r 1.5, A 1) clipped high; (r 0.5, A -1) clipped low; (r 1.0) and masked (r 9) not counted.
    logp = torch.tensor([[math.log(1.5), 0.0, math.log(9.0)], [math.log(0.5), 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    _, stats = policy_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask)
    assert stats["clip_frac_high"] == pytest.approx(1 / 4)
    assert stats["clip_frac_low"] == pytest.approx(1 / 4)
    assert stats["ratio_mean"] == pytest.approx((1.5 + 1 + 0.5 + 1) / 4)  # 1.0
    assert stats["num_tokens"] == 4


# On-policy (ratio 1), so the per-token loss is -A: row 0 = [-1, -1, -1], row 1 = [2, masked, masked].
@pytest.mark.parametrize(
    "aggregation, max_tokens, expected",
    [
        ("token_mean", None, (-3 + 2) / 4),  # -0.25: every token weighs the same
        ("seq_mean", None, (-3 / 3 + 2 / 1) / 2),  # 0.5: every sequence weighs the same
        ("dr_grpo", 4, (-3 + 2) / (2 * 4)),  # -0.125: constant B * max_tokens
        ("dr_grpo", None, (-3 + 2) / (2 * 3)),  # max_tokens defaults to T = 3
    ],
)
def test_aggregations(aggregation: str, max_tokens: int | None, expected: float) -> None:
    logp = torch.full((2, 3), -0.7)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, _ = policy_loss(
        logp, logp.clone(), torch.tensor([1.0, -2.0]), mask, aggregation=aggregation, max_tokens=max_tokens
    )
    assert loss.item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(
    "logp, ref, expected",
    [
        (0.0, math.log(2), 2 - math.log(2) - 1),  # 0.306853
        (0.0, -math.log(2), 0.5 + math.log(2) - 1),  # 0.193147
        (-1.3, -1.3, 0.0),
    ],
)
def test_k3_values(logp: float, ref: float, expected: float) -> None:
    assert k3_kl(torch.tensor(logp), torch.tensor(ref)).item() == pytest.approx(expected, abs=1e-6)


def test_kl_term_in_loss() -> None:
    # on-policy, A = 0, logp = log 0.5, ref = 0: kl = exp(ln 2) - ln 2 - 1 = 0.306853, loss = 0.1 * kl;
    # d kl / d logp = 1 - exp(ref - logp) = 1 - 2 = -1, so grad = 0.1 * -1.
    logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    loss, stats = policy_loss(
        logp, logp.detach().clone(), torch.zeros(1), torch.ones(1, 1), ref_logp=torch.zeros(1, 1), beta=0.1
    )
    loss.backward()
    assert loss.item() == pytest.approx(0.1 * (1 - math.log(2)), abs=1e-6)
    assert stats["kl_mean"] == pytest.approx(1 - math.log(2), abs=1e-6)
    assert logp.grad.item() == pytest.approx(-0.1, abs=1e-6)


def test_on_policy_ratio_is_exactly_one() -> None:
    torch.manual_seed(0)
    logp = -torch.rand(3, 5) * 4
    adv = torch.tensor([0.5, -1.0, 2.0])
    loss, stats = policy_loss(logp, logp.clone(), adv, torch.ones(3, 5))
    assert stats["ratio_mean"] == 1.0
    assert stats["clip_frac_low"] == stats["clip_frac_high"] == 0.0
    assert loss.item() == pytest.approx(-adv.mean().item(), abs=1e-6)


def test_zero_advantage_zero_gradient() -> None:
    torch.manual_seed(0)
    logp = (-torch.rand(2, 4) * 3).requires_grad_()
    loss, _ = policy_loss(logp, -torch.rand(2, 4) * 3, torch.zeros(2), torch.ones(2, 4))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logp.grad, torch.zeros(2, 4))


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean", "dr_grpo"])
def test_masked_inf_nan_never_contribute(aggregation: str) -> None:
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    clean = -torch.rand(3, 2, 4)  # logp, behavior, ref with 0 at masked positions
    clean = torch.where(mask, clean, 0.0)
    dirty = clean.clone()
    dirty[0][~mask] = float("nan")
    dirty[1][~mask] = float("inf")
    dirty[2][~mask] = float("-inf")
    adv = torch.tensor([1.5, -0.5])
    kw = {"aggregation": aggregation, "beta": 0.05}

    results = []
    for logp, behavior, ref in (clean, dirty):
        leaf = logp.clone().requires_grad_()
        loss, stats = policy_loss(leaf, behavior, adv, mask, ref_logp=ref, **kw)
        loss.backward()
        results.append((loss, leaf.grad, stats))
    (clean_loss, clean_grad, clean_stats), (dirty_loss, dirty_grad, dirty_stats) = results
    assert torch.isfinite(dirty_loss)
    assert torch.equal(dirty_loss, clean_loss)
    assert torch.equal(dirty_grad, clean_grad)
    assert torch.equal(dirty_grad[~mask], torch.zeros(int((~mask).sum())))
    assert dirty_stats == clean_stats
