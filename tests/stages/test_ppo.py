"""PPO with a LoRA critic on the tiny random Llama of test_grpo: the critic's loss goes down, the stage writes
a `ppo` checkpoint with the critic beside the adapter and continues it, and the toy reward goes up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stages.common import StageContext
from stages.policy.lora import add_lora
from stages.ppo import run
from stages.reward_ref import RewardRef
from stages.update.ppo import Episode, PPOConfig, load_value_model, train_ppo
from tests.stages.test_grpo import G, TINY_LORA, make_workspace, mean_reward, sample, tiny_llama


def episodes(model, prompts, seed: int) -> list[Episode]:
    samples, rewards, _ = sample(model, prompts, G, seed)
    return [Episode(s.token_ids, s.loss_mask, s.behavior_logprobs, r) for s, r in zip(samples, rewards)]


@pytest.mark.parametrize("credit", ["token", "turn"])
def test_the_critic_learns(tmp_path, credit) -> None:
    """The critic regresses a return it can predict (1 for half the prompts, 0 for the others): its loss
    falls well below where its zero start puts it (the policy held still, lr 0; lam 1: targets = rewards)."""
    model = tiny_llama(0)
    model.save_pretrained(tmp_path / "base", safe_serialization=True)
    policy = add_lora(model, TINY_LORA)
    critic = load_value_model(str(tmp_path / "base"), None, TINY_LORA)
    prompts = torch.randint(0, 64, (4, 4), generator=torch.Generator().manual_seed(0))
    batch = [Episode(e.token_ids, e.loss_mask, e.behavior_logprobs, float(i // G % 2))
             for i, e in enumerate(episodes(policy, prompts, seed=0))]
    config = PPOConfig(credit=credit, epochs=12, lr=0.0, lam=1.0, value_lr=1e-2, lora=TINY_LORA)
    losses = [h["value_loss"] for h in train_ppo(policy, critic, batch, config, temperature=1.0)]
    assert losses[0] == pytest.approx(0.5)  # values 0, returns 0 or 1 half and half
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.slow
def test_stage_writes_the_critic_beside_the_adapter_and_continues_it(tmp_path) -> None:
    ws, parent, batch = make_workspace(tmp_path)
    ctx = StageContext(ws, run_name="ppo-run")
    config = PPOConfig(epochs=2, lr=1e-3, value_lr=1e-2, lora=TINY_LORA)
    ref = run(config, ctx, parent, [batch], RewardRef("toy"))
    assert ref.id.startswith("ck-") and not ref.cached
    row = ws.catalog.get_checkpoint(ref.id)
    assert row["kind"] == "ppo" and row["parent_id"] == parent and row["trained_on"] == {"batches": [batch],
                                                                                        "reward": "toy@v1"}
    folder = Path(row["adapter_uri"])
    assert {"adapter_model.safetensors", "trainer_state.json", "value"} <= {p.name for p in folder.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "head.pt"} <= {p.name for p in (folder / "value").iterdir()}
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["metrics"]["episodes"] == 11 and state["metrics"]["dropped"] == 1  # one null reward
    head = torch.load(folder / "value" / "head.pt", weights_only=True)
    assert head["weight"].abs().sum() > 0  # trained away from its zero start
    assert run(config, ctx, parent, [batch], RewardRef.parse("toy@v1")).cached
    # The next step loads this critic: its first value loss is lower than the fresh critic's was.
    nxt = run(config, ctx, ref.id, [batch], RewardRef("toy"))
    m1 = ws.catalog.get_artifact(ref.id)["meta"]["metrics"]
    m2 = ws.catalog.get_artifact(nxt.id)["meta"]["metrics"]
    assert m2["first_value_loss"] < m1["first_value_loss"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_ppo_reward_goes_up(tmp_path, seed: int) -> None:
    model = tiny_llama(seed)
    model.save_pretrained(tmp_path / "base", safe_serialization=True)
    policy = add_lora(model, TINY_LORA)
    critic = load_value_model(str(tmp_path / "base"), None, TINY_LORA)
    prompts = torch.randint(0, 64, (8, 4), generator=torch.Generator().manual_seed(seed))
    config = PPOConfig(credit="token", epochs=2, lr=3e-2, value_lr=3e-2, micro_batch_size=16, lora=TINY_LORA)
    before = mean_reward(policy, prompts, seed=1000 + seed)
    for step in range(10):
        train_ppo(policy, critic, episodes(policy, prompts, seed=100 * seed + step), config, temperature=1.0)
    after = mean_reward(policy, prompts, seed=2000 + seed)
    assert after > before, f"seed {seed}: mean reward {before:.3f} -> {after:.3f}"
