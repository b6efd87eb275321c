"""DPO through TRL's DPOTrainer on the rollouts' exact tokens: tool results stay out of the loss, the stage
writes a `dpo` checkpoint with its lineage and is cached on rerun, and a tiny model's reward goes up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stages.common import StageContext, base_policy
from stages.dpo import run
from stages.policy.lora import add_lora
from stages.reward_ref import RewardRef
from stages.update.dpo import DPOConfig, trainer_for, train_dpo
from stages.update.pairs import PreferencePair, pair_indices
from storage.schema import RewardRow, Rollout, to_table
from storage.workspace import Workspace
from tests.stages.test_grpo import G, PROMPT_LEN, TINY_LORA, mean_reward, sample, tiny_llama

PROMPT = [1, 17, 30, 4]


def pair(chosen_tail: int, rejected_tail: int) -> PreferencePair:
    """A multi-turn pair: each side = a sampled turn, a tool result (mask 0), a sampled turn, and a final
    tool result (mask 0: the episode ran out of turns after a tool call). The last token is each side's
    tail, the last token of a tool result."""
    chosen = [40, 41, 50, 51, 52, 42, 43, 53, chosen_tail]
    c_mask = [1, 1, 0, 0, 0, 1, 1, 0, 0]
    rejected = [44, 45, 54, 55, 46, 56, rejected_tail]
    r_mask = [1, 1, 0, 0, 1, 0, 0]
    return PreferencePair("c", "r", 1.0, PROMPT, chosen, c_mask, rejected, r_mask)


def grads(model, tokenizer, p: PreferencePair, tmp_path: Path, mask_override: bool = False) -> tuple[float, list[torch.Tensor]]:
    """TRL's DPO loss of one pair and its gradient on the adapter (B = 0 at init: only lora_B gets one)."""
    trainer = trainer_for(model, tokenizer, [p], DPOConfig(micro_batch_size=1, pairs_per_step=1), str(tmp_path))
    example = p.as_example()
    if mask_override:  # TRL's own reading: every completion token trained
        example = {**example, "chosen_mask": [1] * len(p.chosen_ids), "rejected_mask": [1] * len(p.rejected_ids)}
    inputs = trainer.data_collator([example])
    model.zero_grad()
    model.train()
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    out = [q.grad.detach().clone() for q in model.parameters() if q.requires_grad and q.grad is not None]
    if "ref" in model.peft_config:
        model.delete_adapter("ref")
    model.set_adapter("default")
    return float(loss.detach()), out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_tool_result_token_is_out_of_the_dpo_loss(tmp_path, tiny_model_dir, tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = add_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), TINY_LORA)
    loss, g = grads(model, tokenizer, pair(60, 61), tmp_path)
    assert loss == pytest.approx(0.6931, abs=1e-3)  # policy = reference at the start: -log sigmoid(0)
    assert any(x.abs().sum() > 0 for x in g)
    # Another tool-result token at the end of each side: nothing the policy chose changed, so neither did
    # the loss nor its gradient ...
    loss2, g2 = grads(model, tokenizer, pair(700, 900), tmp_path)
    assert loss2 == loss and same(g, g2)
    # ... while with TRL's own completion mask (every completion token) the tool tokens would be trained.
    _, g3 = grads(model, tokenizer, pair(60, 61), tmp_path, mask_override=True)
    _, g4 = grads(model, tokenizer, pair(700, 900), tmp_path, mask_override=True)
    assert not same(g3, g4)


def make_workspace(root: Path, model_dir: Path) -> tuple[Workspace, str, str]:
    """A workspace with the tiny model as base policy and one scored batch: 3 groups of 4 two-turn episodes
    (a tool result in the middle), rewards with a tie group and an unscored row."""
    ws = Workspace.open(root / "ws")
    parent = base_policy(ws, str(model_dir))
    g = torch.Generator().manual_seed(0)
    batch, rollouts = "ro-dpo", []
    for i in range(12):
        prompt = [1, 100 + i // 4, 2]
        turn1, tool, turn2 = (torch.randint(3, 5000, (n,), generator=g).tolist() for n in (3, 2, 3))
        tokens = prompt + turn1 + tool + turn2
        mask = [0] * 3 + [1] * 3 + [0] * 2 + [1] * 3
        rollouts.append(Rollout(
            rollout_id=f"{batch}-{i}", batch_id=batch, policy_id=parent, task="toy", split="train",
            prompt_id=f"p{i // 4}", group_id=f"{batch}-g{i // 4}", sample_idx=i % 4, messages=[], token_ids=tokens,
            loss_mask=mask, behavior_logprobs=[0.0] * len(tokens), num_turns=2, num_tool_calls=1,
            finish_reason="stop", truncated=False, metadata={}, sampling={"temperature": 1.0}, seed=i, gen_seconds=0.1))
    ws.write_part("rollouts", batch, to_table(rollouts), part="part-0")
    ws.catalog.complete_artifact(batch, "rollouts", "rollout", [parent], "cfg")
    values = [0.0, 1.0, 0.5, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, None, 1.0, 0.2]
    rows = [RewardRow(r.rollout_id, batch, "toy", "v1", v, {}, None if v is not None else "boom", "rw-toy")
            for r, v in zip(rollouts, values)]
    ws.write_part("rewards", "rw-toy", to_table(rows), part="part-0")
    ws.catalog.complete_artifact("rw-toy", "rewards", "score", [batch], "cfg")
    return ws, parent, batch


@pytest.mark.slow
def test_stage_writes_a_dpo_checkpoint_with_lineage_and_resumes(tmp_path, tiny_model_dir) -> None:
    ws, parent, batch = make_workspace(tmp_path, tiny_model_dir)
    ctx = StageContext(ws, run_name="dpo-run")
    config = DPOConfig(pairing="all", lr=1e-2, pairs_per_step=2, micro_batch_size=2, lora=TINY_LORA)
    ref = run(config, ctx, parent, [batch], RewardRef("toy"))
    assert ref.kind == "checkpoint" and not ref.cached and ref.id.startswith("ck-")
    row = ws.catalog.get_checkpoint(ref.id)
    assert row["kind"] == "dpo" and row["parent_id"] == parent and row["step"] == 1
    assert row["trained_on"] == {"batches": [batch], "reward": "toy@v1"} and row["mlflow_run_id"]
    folder = Path(row["adapter_uri"])
    assert folder == ws.settings.checkpoints_dir / ref.id
    assert not (folder / "ref").exists()  # TRL's reference copy is not saved
    state = json.loads((folder / "trainer_state.json").read_text())
    # group 0 [0, 1, .5, 0]: 5 ordered pairs; group 1 tied: none; group 2 [0, -, 1, .2]: 3 pairs
    assert len(state["pairs"]) == 8 and state["metrics"]["tied_groups"] == 1
    assert state["metrics"]["dropped_null_rewards"] == 1 and state["metrics"]["optimizer_steps"] == 4
    assert state["metrics"]["tokens"] == 8 * 2 * 6  # 6 sampled tokens a side, tool results not counted
    b = {k: v for k, v in load_file(folder / "adapter_model.safetensors").items() if "lora_B" in k}
    assert b and any(v.abs().sum() > 0 for v in b.values())  # a fresh adapter's B starts at 0: it trained
    history = ws.tracker.client.get_metric_history(row["mlflow_run_id"], "train/loss")
    assert len(history) == 4

    mtime = (folder / "adapter_model.safetensors").stat().st_mtime_ns
    again = run(config, ctx, parent, [batch], RewardRef.parse("toy@v1"))
    assert again.id == ref.id and again.cached
    assert (folder / "adapter_model.safetensors").stat().st_mtime_ns == mtime
    # A second DPO step from the first: its reference is the first's adapter.
    nxt = run(config, ctx, ref.id, [batch], RewardRef("toy"))
    assert ws.catalog.get_checkpoint(nxt.id)["parent_id"] == ref.id
    assert ws.catalog.get_checkpoint(nxt.id)["step"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_dpo_reward_goes_up(seed: int, tokenizer) -> None:
    """DPO on best-vs-worst pairs of freshly sampled groups (the toy task of test_grpo) raises the reward."""
    from tests.stages.test_grpo import toy_reward  # noqa: F401 - the reward `sample` scores with

    model = add_lora(tiny_llama(seed), TINY_LORA)
    prompts = torch.randint(0, 64, (8, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))
    config = DPOConfig(lr=3e-2, beta=0.5, pairs_per_step=8, micro_batch_size=8, lora=TINY_LORA)
    before = mean_reward(model, prompts, seed=1000 + seed)
    for step in range(8):
        samples, rewards, groups = sample(model, prompts, G, seed=100 * seed + step)
        pairs = []
        for g in range(len(prompts)):
            idx = [i for i, x in enumerate(groups) if x == g]
            for c, r in pair_indices([rewards[i] for i in idx], "best_worst", 0.0):
                sc, sr = samples[idx[c]], samples[idx[r]]
                pairs.append(PreferencePair(str(c), str(r), 1.0, sc.token_ids[:PROMPT_LEN], sc.token_ids[PROMPT_LEN:],
                                            sc.loss_mask[PROMPT_LEN:], sr.token_ids[PROMPT_LEN:], sr.loss_mask[PROMPT_LEN:]))
        train_dpo(model, tokenizer, pairs, config)
    after = mean_reward(model, prompts, seed=2000 + seed)
    assert after > before, f"seed {seed}: mean reward {before:.3f} -> {after:.3f}"
