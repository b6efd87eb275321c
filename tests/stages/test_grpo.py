"""GRPO stage on a tiny random Llama (vocab 64): it learns a verifiable toy task, trains only the
adapter, is on-policy on its first pass, and runs end to end on a workspace, cached and crash-safe."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from stages.common import StageContext, base_policy
from stages.grpo import run
from stages.policy.logprobs import token_logprobs
from stages.policy.lora import LoRASettings, add_lora
from stages.reward_ref import RewardRef
from stages.update.config import GRPOConfig
from stages.update.data import Sample, training_data
from stages.update.train import train_on_batch
from storage.schema import RewardRow, Rollout, to_table
from storage.workspace import Workspace
from tests.processes import kill, wait_until

VOCAB = 64
TARGET = 8  # toy task: reward = fraction of completion tokens with id < TARGET (1/8 of them at random)
PROMPT_LEN, NEW_TOKENS, G = 4, 8, 8
TINY_LORA = LoRASettings(r=8, alpha=16)


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0, initializer_range=0.2)
    return LlamaForCausalLM(config)


def toy_reward(completion: list[int]) -> float:
    return sum(t < TARGET for t in completion) / len(completion)


@torch.no_grad()
def sample(model, prompts: torch.Tensor, n: int, seed: int) -> tuple[list[Sample], list[float], list[int]]:
    """n completions per prompt (prompts: (P, PROMPT_LEN)), with behaviour log-probs from the same
    model; returns (samples, rewards, group index of each sample)."""
    torch.manual_seed(seed)
    model.eval()
    ids = prompts.repeat_interleave(n, dim=0)  # (P*n, PROMPT_LEN): group members are adjacent
    # Plain sampling from the full softmax (no top-k/top-p), so behaviour log-probs are exact.
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, top_k=0, top_p=1.0, temperature=1.0)  # (P*n, T)
    mask = torch.zeros_like(out)
    mask[:, PROMPT_LEN:] = 1
    logp = token_logprobs(model, out, torch.ones_like(out), mask)  # (P*n, T)
    samples = [Sample(o.tolist(), m.tolist(), lp.tolist()) for o, m, lp in zip(out, mask, logp)]
    rewards = [toy_reward(o[PROMPT_LEN:].tolist()) for o in out]
    return samples, rewards, [i // n for i in range(len(out))]


def mean_reward(model, prompts: torch.Tensor, seed: int) -> float:
    _, rewards, _ = sample(model, prompts, 32, seed)
    return sum(rewards) / len(rewards)


def grpo_step(model, optimizer, prompts: torch.Tensor, config: GRPOConfig, seed: int) -> list[dict[str, float]]:
    from stages.update.loss import group_advantages

    samples, rewards, groups = sample(model, prompts, G, seed)
    advantages = group_advantages(torch.tensor(rewards), groups, config.scale, config.baseline)
    return train_on_batch(model, optimizer, samples, advantages, config, temperature=1.0)


def tiny_setup(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """A tiny Llama with a fresh LoRA adapter, its AdamW, and 8 random prompts."""
    model = add_lora(tiny_llama(seed), TINY_LORA)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARN.lr)
    prompts = torch.randint(0, VOCAB, (8, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))
    return model, optimizer, prompts


# A high lr for a tiny random model: 10 steps must move a measurable reward.
LEARN = GRPOConfig(lr=3e-2, micro_batch_size=16, lora=TINY_LORA)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reward_goes_up(seed: int) -> None:
    model, optimizer, prompts = tiny_setup(seed)
    before = mean_reward(model, prompts, seed=1000 + seed)  # fresh samples, not the training ones
    for step in range(10):
        grpo_step(model, optimizer, prompts, LEARN, seed=100 * seed + step)
    after = mean_reward(model, prompts, seed=2000 + seed)
    assert after > before, f"seed {seed}: mean reward {before:.3f} -> {after:.3f}"


def test_only_the_adapter_changes() -> None:
    model, optimizer, prompts = tiny_setup(0)
    before = copy.deepcopy(model.state_dict())
    grpo_step(model, optimizer, prompts, LEARN, seed=0)
    after = model.state_dict()
    lora = [k for k in before if "lora_" in k]
    assert lora and len(lora) < len(before)
    for k in before:
        if "lora_" not in k:
            assert torch.equal(before[k], after[k]), f"base weight {k} changed"
    # lora_B starts at zero, so the first step moves every B (A's gradient is zero until B is not)
    for k in (k for k in lora if "lora_B" in k):
        assert not torch.equal(before[k], after[k]), f"adapter weight {k} did not change"


def test_first_pass_is_on_policy() -> None:
    model, optimizer, prompts = tiny_setup(0)
    history = grpo_step(model, optimizer, prompts, LEARN.model_copy(update={"epochs": 2}), seed=0)
    assert abs(history[0]["ratio_mean"] - 1.0) < 1e-5
    assert history[0]["clip_frac"] == 0.0
    assert abs(history[1]["ratio_mean"] - 1.0) > 1e-4  # the second pass is off-policy: the first step moved it



def test_first_pass_is_on_policy_with_an_sft_adapter_trained_with_dropout() -> None:
    # An SFT adapter keeps its lora_dropout; behaviour log-probs come from generation (no dropout), so the
    # update's forward passes must not drop anything either: ratio exactly 1 on the first pass.
    model = add_lora(tiny_llama(0), TINY_LORA.model_copy(update={"dropout": 0.5}))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARN.lr)
    prompts = torch.randint(0, VOCAB, (8, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    grpo_step(model, optimizer, prompts, LEARN, seed=0)  # B is no longer 0: dropout would now change outputs
    history = grpo_step(model, optimizer, prompts, LEARN, seed=1)
    assert history[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and history[0]["clip_frac"] == 0.0

def test_kl_to_the_base_with_the_adapter_disabled() -> None:
    model, optimizer, prompts = tiny_setup(0)
    history = grpo_step(model, optimizer, prompts, LEARN.model_copy(update={"epochs": 2, "beta": 0.1}), seed=0)
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # a fresh adapter (B = 0) is the base model
    assert history[1]["kl"] > 1e-6  # after one step the adapted policy has moved away from the base
    assert "kl" not in grpo_step(model, optimizer, prompts, LEARN, seed=1)[0]  # beta = 0: not computed


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean", "dr_grpo"])
def test_micro_batches_accumulate_to_the_full_batch_step(aggregation: str) -> None:
    """Micro-batches of 3 (uneven lengths, uneven last batch) give the step of one batch of all."""
    from stages.update.loss import group_advantages

    model, _, prompts = tiny_setup(0)
    samples, rewards, groups = sample(model, prompts[:2], G, seed=0)
    # uneven lengths: drop up to 3 trailing completion tokens, so micro-batches hold different token counts
    samples = [Sample(s.token_ids[: len(s.token_ids) - i % 4], s.loss_mask[: len(s.token_ids) - i % 4],
                      s.behavior_logprobs[: len(s.token_ids) - i % 4]) for i, s in enumerate(samples)]
    advantages = group_advantages(torch.tensor(rewards), groups)
    params = []
    longest = max(len(s.token_ids) for s in samples)
    # one batch of all; 3 sequences each; a token budget that fits two of the longest
    for size, budget in ((len(samples), None), (3, None), (len(samples), 2 * longest)):
        m = copy.deepcopy(model)
        sgd = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=1.0)
        config = LEARN.model_copy(update={"micro_batch_size": size, "micro_batch_tokens": budget,
                                          "aggregation": aggregation, "max_grad_norm": 1e9})
        train_on_batch(m, sgd, samples, advantages, config, temperature=1.0)
        params.append(torch.cat([p.detach().flatten() for p in m.parameters() if p.requires_grad]))
    torch.testing.assert_close(params[1], params[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(params[2], params[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_shared_prompt_runs_once_and_gives_the_same_update(checkpointing: bool) -> None:
    """The G samples of a group continue one prompt: run it once per micro-batch (prefix + continuations)
    and the update equals running every sample whole, with activation checkpointing on or off."""
    from stages.update.loss import group_advantages

    model, _, prompts = tiny_setup(0)
    samples, rewards, groups = sample(model, prompts[:2], G, seed=0)
    samples = [Sample(s.token_ids[: len(s.token_ids) - i % 4], s.loss_mask[: len(s.token_ids) - i % 4],
                      s.behavior_logprobs[: len(s.token_ids) - i % 4]) for i, s in enumerate(samples)]
    alone, *_ = sample(model, prompts[2:3], 1, seed=1)  # a prompt no other sample shares: the plain path
    samples, rewards, groups = samples + alone, rewards + [0.5], groups + [2]
    advantages = group_advantages(torch.tensor(rewards), groups)
    advantages[-1] = 1.0
    params, histories, prefixes = [], [], []
    for share in (False, True):
        m = copy.deepcopy(model)
        calls: list[tuple[int, ...]] = []
        decoder = m.get_base_model().get_decoder()
        hook = decoder.register_forward_pre_hook(lambda mod, a, k: calls.append(tuple(k["input_ids"].shape)),
                                                 with_kwargs=True)
        sgd = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=1.0)
        config = LEARN.model_copy(update={"micro_batch_size": 5, "share_prompts": share, "max_grad_norm": 1e9,
                                          "activation_checkpointing": checkpointing})
        histories.append(train_on_batch(m, sgd, samples, advantages, config, temperature=1.0)[0])
        hook.remove()
        params.append(torch.cat([p.detach().flatten() for p in m.parameters() if p.requires_grad]))
        prefixes.append([c for c in calls if c == (1, PROMPT_LEN)])
    torch.testing.assert_close(params[1], params[0], atol=1e-5, rtol=1e-4)
    for k in ("loss", "ratio_mean", "clip_frac", "grad_norm", "tokens"):
        assert histories[1][k] == pytest.approx(histories[0][k], rel=1e-4, abs=1e-6), k
    # 2 groups of 8 in micro-batches of <= 5 continuations: each group's prompt runs once per micro-batch
    assert prefixes == [[], [(1, PROMPT_LEN)] * 4]


@pytest.mark.parametrize(("lengths", "size", "budget", "expected"), [
    ([5, 3, 9, 4], 8, None, [[1, 3, 0, 2]]),  # sorted by length, all in one
    ([5, 3, 9, 4], 2, None, [[1, 3], [0, 2]]),  # at most 2 sequences
    ([5, 3, 9, 4], 8, 12, [[1, 3], [0], [2]]),  # 3 x 5 = 15 padded tokens > 12; 9 goes alone
    ([50, 3], 8, 10, [[1], [0]]),  # a sequence over the budget still trains, alone
])
def test_micro_batches_respect_the_sequence_and_token_limits(lengths, size, budget, expected) -> None:
    from stages.update.train import _micro_batch_indices

    assert _micro_batch_indices(lengths, size, budget) == expected


# -- the stage, end to end on a workspace -----------------------------------------------------

STAGE = GRPOConfig(lora=TINY_LORA, micro_batch_size=4)
REWARDS = [[0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 1.0, None, 1.0]]  # group 1: no signal; one error


def make_workspace(root: Path) -> tuple[Workspace, str, str]:
    """A workspace with a tiny base model registered as a policy and one scored rollout batch
    (3 groups of 4) sampled from it; returns (workspace, base policy id, rollout batch id)."""
    ws = Workspace.open(root / "ws")
    model = tiny_llama(0)
    model.save_pretrained(root / "base", safe_serialization=True)
    parent = base_policy(ws, str(root / "base"))
    prompts = torch.randint(0, VOCAB, (3, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    samples, _, groups = sample(model, prompts, 4, seed=0)
    batch = "ro-toy"
    rollouts = [
        Rollout(rollout_id=f"{batch}-{i}", batch_id=batch, policy_id=parent, task="toy", split="train",
                prompt_id=f"p{g}", group_id=f"{batch}-g{g}", sample_idx=i % 4, messages=[], token_ids=s.token_ids,
                loss_mask=s.loss_mask, behavior_logprobs=s.behavior_logprobs, num_turns=1, num_tool_calls=0,
                finish_reason="max_tokens", truncated=True, metadata={}, sampling={"temperature": 1.0}, seed=i,
                gen_seconds=0.1)
        for i, (s, g) in enumerate(zip(samples, groups))
    ]
    ws.write_part("rollouts", batch, to_table(rollouts), part="part-0")
    ws.catalog.complete_artifact(batch, "rollouts", "rollout", [parent], "cfg")
    values = [v for group in REWARDS for v in group]
    rows = [RewardRow(r.rollout_id, batch, "toy", "v1", v, {}, None if v is not None else "boom", "rw-toy")
            for r, v in zip(rollouts, values)]
    ws.write_part("rewards", "rw-toy", to_table(rows), part="part-0")
    ws.catalog.complete_artifact("rw-toy", "rewards", "score", [batch], "cfg")
    return ws, parent, batch


def test_stage_end_to_end(tmp_path: Path) -> None:
    ws, parent, batch = make_workspace(tmp_path)
    ctx = StageContext(ws, run_name="toy-run")
    ref = run(STAGE, ctx, parent, [batch], RewardRef("toy"))
    assert ref.kind == "checkpoint" and not ref.cached

    row = ws.catalog.get_checkpoint(ref.id)
    assert row["parent_id"] == parent and row["kind"] == "grpo" and row["step"] == 1
    assert row["trained_on"] == {"batches": [batch], "reward": "toy@v1"}
    assert row["run_name"] == "toy-run" and row["mlflow_run_id"]
    folder = Path(row["adapter_uri"])
    assert folder == ws.settings.checkpoints_dir / ref.id
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "trainer_state.json"} <= {
        p.name for p in folder.iterdir()}
    assert json.loads((folder / "trainer_state.json").read_text())["step"] == 1

    metrics = ws.catalog.get_artifact(ref.id)["meta"]["metrics"]
    assert metrics["groups"] == 3 and metrics["zero_variance_groups"] == 1
    assert metrics["frac_zero_variance_groups"] == pytest.approx(1 / 3)
    assert metrics["dropped_null_rewards"] == 1 and metrics["trained_rollouts"] == 7
    assert metrics["first_pass_ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # sampled from the parent (B = 0)
    assert metrics["tokens"] == 7 * NEW_TOKENS and metrics["tokens_per_s"] > 0
    per_epoch = ws.tracker.client.get_metric_history(row["mlflow_run_id"], "train/loss")
    assert [m.step for m in per_epoch] == list(range(STAGE.epochs))

    # Same inputs, the reward spelled with its version: the same checkpoint, not retrained.
    mtime = (folder / "adapter_model.safetensors").stat().st_mtime_ns
    again = run(STAGE, ctx, parent, [batch], RewardRef.parse("toy@v1"))
    assert again.id == ref.id and again.cached
    assert (folder / "adapter_model.safetensors").stat().st_mtime_ns == mtime
    assert [r["status"] for r in ws.catalog.stage_runs(ref.id)] == ["complete", "cached"]

    # A second step from the new checkpoint continues its optimizer state.
    nxt = run(STAGE, ctx, ref.id, [batch], RewardRef("toy"))
    row2 = ws.catalog.get_checkpoint(nxt.id)
    assert row2["parent_id"] == ref.id and row2["step"] == 2
    opt = torch.load(Path(row2["adapter_uri"]) / "optimizer.pt", weights_only=True)
    assert {float(s["step"]) for s in opt["state"].values()} == {2.0}



def test_zero_variance_groups_are_skipped_unless_asked_to_train_on_every_completion() -> None:
    def row(i: int, group: str, value: float) -> dict:
        return {"rollout_id": f"r{i}", "batch_id": "b", "group_id": group, "token_ids": [1, 2, 3], "loss_mask": [0, 1, 1],
                "behavior_logprobs": [0.0, -1.0, -1.0], "sampling": json.dumps({"temperature": 1.0}), "value": value}

    rows = [row(0, "a", 0.0), row(1, "a", 1.0), row(2, "z", 0.0), row(3, "z", 0.0)]
    skipped = training_data(rows, scale="group", baseline="mean")
    every = training_data(rows, scale="group", baseline="mean", skip_zero_variance=False)
    assert len(skipped.samples) == 2 and len(every.samples) == 4
    assert every.advantages.tolist()[2:] == [0.0, 0.0]  # trained on, with no signal
    assert skipped.metrics["zero_variance_groups"] == every.metrics["zero_variance_groups"] == 1.0


def test_a_batch_without_signal_steps_only_when_asked() -> None:
    """All groups agree: no optimizer step by default; with step_without_signal AdamW's momentum moves the weights."""
    model, optimizer, prompts = tiny_setup(0)
    grpo_step(model, optimizer, prompts, LEARN, seed=0)  # one real step: AdamW has momentum now
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    assert train_on_batch(model, optimizer, [], torch.zeros(0), LEARN, temperature=1.0) == []
    assert all(torch.equal(a, p) for a, p in zip(before, (p for p in model.parameters() if p.requires_grad)))
    steps = optimizer.state[next(iter(optimizer.state))]["step"].item()
    config = LEARN.model_copy(update={"step_without_signal": True})
    assert train_on_batch(model, optimizer, [], torch.zeros(0), config, temperature=1.0) == []
    after = [p.detach() for p in model.parameters() if p.requires_grad]
    assert any(not torch.equal(a, p) for a, p in zip(before, after))
    assert optimizer.state[next(iter(optimizer.state))]["step"].item() == steps + 1


def test_update_takes_the_rollouts_temperature_and_refuses_a_mix() -> None:
    def row(i: int, temperature: float) -> dict:
        return {"rollout_id": f"r{i}", "batch_id": "b", "group_id": "g", "token_ids": [1, 2], "loss_mask": [0, 1],
                "behavior_logprobs": [0.0, -1.0], "sampling": json.dumps({"temperature": temperature}), "value": float(i)}

    assert training_data([row(0, 0.7), row(1, 0.7)], scale="group", baseline="mean").temperature == 0.7
    with pytest.raises(ValueError, match="temperatures"):
        training_data([row(0, 0.7), row(1, 1.0)], scale="group", baseline="mean")


KILLED = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import stages.grpo as grpo
    from stages.common import StageContext
    from stages.reward_ref import RewardRef
    from stages.update.config import GRPOConfig
    from storage.workspace import Workspace

    ws_dir, parent, batch, config, phase, marker = sys.argv[1:]
    if phase == "train":  # signal, then train "forever" (the id was computed from the real config)
        import stages.update.workers as where
        train = where.train_on_batch
        def forever(model, optimizer, samples, advantages, config, temperature):
            Path(marker).touch()
            return train(model, optimizer, samples, advantages, config.model_copy(update={"epochs": 10**6}), temperature)
        where.train_on_batch = forever
    else:  # "save": stop just before the temp folder is renamed to its final name
        rename = os.replace
        def stall(src, dst):
            if ".tmp-" in str(src) and Path(src).is_dir():
                Path(marker).touch()
                time.sleep(3600)
            rename(src, dst)
        os.replace = stall
    grpo.run(GRPOConfig.model_validate_json(config), StageContext(Workspace.open(ws_dir)), parent, [batch], RewardRef("toy"))
""")


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["train", "save"])
def test_killed_stage_leaves_no_partial_checkpoint(tmp_path: Path, phase: str) -> None:
    ws, parent, batch = make_workspace(tmp_path)
    marker = tmp_path / "marker"
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(ws.root), parent, batch, STAGE.model_dump_json(), phase,
                             str(marker)], cwd=repo)
    wait_until(marker.exists, proc, f"the stage reached {phase} (it ended before it could be killed)")
    time.sleep(0.5 if phase == "train" else 0)  # some optimizer steps in
    kill(proc, group=False)

    ckpts = ws.settings.checkpoints_dir
    leftover = sorted(p.name for p in ckpts.iterdir()) if ckpts.exists() else []
    assert all(".tmp-" in name for name in leftover)  # nothing under a final name
    assert bool(leftover) == (phase == "save")
    assert [c["kind"] for c in ws.catalog.checkpoints()] == ["base"]

    ref = run(STAGE, StageContext(ws), parent, [batch], RewardRef("toy"))
    assert not ref.cached
    assert sorted(p.name for p in ckpts.iterdir()) == [ref.id]  # one checkpoint; the stale temp folder is gone
    assert (ckpts / ref.id / "adapter_model.safetensors").exists()
    assert [c["policy_id"] for c in ws.catalog.checkpoints() if c["kind"] == "grpo"] == [ref.id]
