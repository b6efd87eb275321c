"""PPO's credit assignment against hand-computed numbers: turns, GAE, per-token and per-turn spreading."""

from __future__ import annotations

import pytest
import torch

from stages.update.gae import clipped_token_loss, episode_advantages, gae, spread, step_positions, turn_spans


@pytest.mark.parametrize("mask, spans", [
    ([0, 0, 1, 1, 0, 0, 1, 1, 1], [(2, 4), (6, 9)]),
    ([0, 1], [(1, 2)]),
    ([0, 0, 0], []),
    ([0, 1, 0, 1, 0], [(1, 2), (3, 4)]),
])
def test_turn_spans(mask, spans) -> None:
    assert turn_spans(mask) == spans


@pytest.mark.parametrize("rewards, values, gamma, lam, advantages", [
    # deltas: 0 + .6 - .5 = .1, 0 + .7 - .6 = .1, 1 + 0 - .7 = .3
    # A2 = .3, A1 = .1 + .9 * .3 = .37, A0 = .1 + .9 * .37 = .433
    ([0, 0, 1], [0.5, 0.6, 0.7], 1.0, 0.9, [0.433, 0.37, 0.3]),
    # lam = 1: Monte Carlo, A_t = R - V_t
    ([0, 0, 1], [0.5, 0.6, 0.7], 1.0, 1.0, [0.5, 0.4, 0.3]),
    # lam = 0: one-step TD errors
    ([0, 0, 1], [0.5, 0.6, 0.7], 1.0, 0.0, [0.1, 0.1, 0.3]),
    # gamma = .5, lam = 1: A2 = 1 - .7 = .3; A1 = .5 * .7 - .6 + .5 * .3 = -.1; A0 = .5 * .6 - .5 + .5 * -.1 = -.25
    ([0, 0, 1], [0.5, 0.6, 0.7], 0.5, 1.0, [-0.25, -0.1, 0.3]),
])
def test_gae(rewards, values, gamma, lam, advantages) -> None:
    adv, ret = gae(rewards, values, gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(advantages), atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, adv + torch.tensor(values))  # the critic's targets


def test_per_token_credit() -> None:
    mask = [0, 0, 1, 1, 0, 1]  # 3 sampled tokens at 2, 3, 5: three steps
    assert step_positions(mask, "token") == [2, 3, 5]
    per_token, ret = episode_advantages(1.0, torch.tensor([0.5, 0.6, 0.7]), mask, "token", gamma=1.0, lam=0.9)
    torch.testing.assert_close(per_token, torch.tensor([0, 0, 0.433, 0.37, 0, 0.3]), atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, torch.tensor([0.933, 0.97, 1.0]), atol=1e-6, rtol=0)


def test_per_turn_credit() -> None:
    # two assistant turns [2, 4) and [6, 9), a tool result (4, 5) between; values at the turn boundaries
    mask = [0, 0, 1, 1, 0, 0, 1, 1, 1]
    assert step_positions(mask, "turn") == [2, 6]
    # reward 0 (failed episode); V(turn 1) = .2, V(turn 2) = .8: turn 1 looked good afterwards, turn 2 failed.
    # A2 = 0 - .8 = -.8; A1 = 0 + .8 - .2 + .95 * -.8 = -.16
    per_token, ret = episode_advantages(0.0, torch.tensor([0.2, 0.8]), mask, "turn", gamma=1.0, lam=0.95)
    torch.testing.assert_close(per_token, torch.tensor([0, 0, -0.16, -0.16, 0, 0, -0.8, -0.8, -0.8]), atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, torch.tensor([0.04, 0.0]), atol=1e-6, rtol=0)
    # with lam = 0 the first turn's credit is its own TD error: + .6, though the episode failed
    per_token, _ = episode_advantages(0.0, torch.tensor([0.2, 0.8]), mask, "turn", gamma=1.0, lam=0.0)
    assert per_token[2].item() == pytest.approx(0.6) and per_token[6].item() == pytest.approx(-0.8)


def test_spread_per_token_and_per_turn() -> None:
    mask = [0, 1, 1, 0, 1]
    torch.testing.assert_close(spread(torch.tensor([1.0, 2.0, 3.0]), mask, "token"), torch.tensor([0, 1.0, 2.0, 0, 3.0]))
    torch.testing.assert_close(spread(torch.tensor([1.0, 3.0]), mask, "turn"), torch.tensor([0, 1.0, 1.0, 0, 3.0]))


def test_clipped_token_loss() -> None:
    # ratio e^.5 = 1.6487 clipped to 1.2 for A = +1 (min picks the clipped 1.2); A = -1 at ratio 1: -(-1) = 1
    logp = torch.tensor([[0.5, 0.0, 9.0]])
    loss = clipped_token_loss(logp, torch.zeros(1, 3), torch.tensor([[1.0, -1.0, 5.0]]),
                              torch.tensor([[1, 1, 0]]), eps=0.2)
    assert loss.item() == pytest.approx((-1.2 + 1.0) / 2)
