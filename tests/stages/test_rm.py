"""The learned reward model (`rlops stage rm`, stages/rm.py; `rewards.rm.learned`): trained from the pairs a reward
orders, it orders held-out pairs the same way above chance; its checkpoint id versions the reward."""

from __future__ import annotations

from pathlib import Path

import torch

from rewards.base import RewardSpec, reward_version
from rewards.rm import learned
from stages import rm
from stages.common import StageContext, base_policy
from stages.reward_ref import RewardRef
from stages.update.rm import RMConfig
from storage.schema import RewardRow, Rollout, to_table
from storage.workspace import Workspace
from tests.stages.test_grpo import PROMPT_LEN, TINY_LORA, VOCAB, sample, tiny_llama, toy_reward


def episodes(model, batch: str, policy: str, prompts: int, seed: int) -> list[Rollout]:
    """8 sampled completions of each of `prompts` random prompts, as rollouts of `batch`."""
    ids = torch.randint(0, VOCAB, (prompts, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))
    samples, _, groups = sample(model, ids, 8, seed=seed)
    return [Rollout(rollout_id=f"{batch}-{i}", batch_id=batch, policy_id=policy, task="toy", split="train",
                    prompt_id=f"p{g}", group_id=f"{batch}-g{g}", sample_idx=i % 8, messages=[], token_ids=s.token_ids,
                    loss_mask=s.loss_mask, behavior_logprobs=s.behavior_logprobs, num_turns=1, num_tool_calls=0,
                    finish_reason="length", truncated=False, metadata={}, sampling={"temperature": 1.0}, seed=i,
                    gen_seconds=0.1) for i, (s, g) in enumerate(zip(samples, groups))]


def value(r: Rollout) -> float:
    return toy_reward(r.token_ids[PROMPT_LEN:])  # the share of low token ids in the completion


def test_a_reward_model_learns_the_order_a_reward_gives(tmp_path: Path) -> None:
    ws = Workspace.open(tmp_path / "ws")
    model = tiny_llama(0)
    model.save_pretrained(tmp_path / "base", safe_serialization=True)
    parent = base_policy(ws, str(tmp_path / "base"))
    train = episodes(model, "ro-train", parent, prompts=24, seed=0)
    ws.write_part("rollouts", "ro-train", to_table(train), part="part-0")
    ws.catalog.complete_artifact("ro-train", "rollouts", "rollout", [parent], "cfg")
    rows = [RewardRow(r.rollout_id, "ro-train", "toy", "v1", value(r), {}, None, "rw-toy") for r in train]
    ws.write_part("rewards", "rw-toy", to_table(rows), part="part-0")
    ws.catalog.complete_artifact("rw-toy", "rewards", "score", ["ro-train"], "cfg")

    config = RMConfig(lr=1e-2, head_lr=3e-2, epochs=8, lora=TINY_LORA)  # held-out agreement 0.67 (train 0.89)
    ref = rm.run(config, StageContext(ws, run_name="rm"), parent, ["ro-train"], RewardRef("toy"))
    checkpoint = ws.catalog.get_checkpoint(ref.id)
    assert checkpoint["kind"] == "rm" and checkpoint["trained_on"] == {"batches": ["ro-train"], "reward": "toy@v1"}
    metrics = ws.catalog.get_artifact(ref.id)["meta"]["metrics"]
    assert metrics["pairs"] > 100

    # held out: other prompts, other samples; every pair of a group whose values differ
    held_out = episodes(model, "ro-held-out", parent, prompts=16, seed=1)
    scores = {r.rollout_id: learned(r, checkpoint=ref.id, checkpoints_dir=str(ws.settings.checkpoints_dir))[0]
              for r in held_out}
    pairs = [(a, b) for a in held_out for b in held_out
             if a.group_id == b.group_id and value(a) > value(b)]
    agree = sum(scores[a.rollout_id] > scores[b.rollout_id] for a, b in pairs) / len(pairs)
    assert len(pairs) > 100 and agree > 0.6, f"the reward model agrees with the reward on {agree:.2f} of {len(pairs)} pairs"

    # the checkpoint id is the reward's version: another reward model, another version
    spec = RewardSpec(name="rm", fn="rewards.rm.learned", params={"checkpoint": ref.id})
    other = RewardSpec(name="rm", fn="rewards.rm.learned", params={"checkpoint": "ck-other"})
    assert reward_version(spec) != reward_version(other)
    assert reward_version(spec) == reward_version(RewardSpec(name="rm", fn="rewards.rm.learned",
                                                             params={"checkpoint": ref.id, "checkpoints_dir": "/x"}))
