"""Multi-worker GRPO (a resident Ray worker group, torch.distributed with gloo on CPU) gives the update of one worker."""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from stages.common import StageContext
from stages.policy.lora import add_lora
from stages.update.config import GRPOConfig
from stages.update.data import Sample
from stages.update.train import train_on_batch
from stages.update.shards import scored_tokens, shard_weight
from stages.update.workers import train
from storage.workspace import Workspace

if TYPE_CHECKING:
    import torch

TOLERANCE = 1e-5  # max |Δ| of any adapter weight: float summation order differs, nothing else


def _batch(vocab: int, n: int = 6) -> tuple[list[Sample], "torch.Tensor"]:
    """n sequences of different lengths (so shards hold different token counts), with advantages."""
    import torch

    g = torch.Generator().manual_seed(1)
    samples = []
    for i in range(n):
        prompt, completion = 5 + i % 3, 4 + 3 * i
        ids = torch.randint(0, vocab, (prompt + completion,), generator=g).tolist()
        # Behaviour log-probs a little off the policy's: the ratio and clipping do something.
        samples.append(Sample(ids, [0] * prompt + [1] * completion, (-torch.rand(prompt + completion, generator=g) * 3).tolist()))
    return samples, torch.randn(n, generator=g)


def _policy(tiny_model_dir: Path, config: GRPOConfig):
    import torch
    from transformers import AutoModelForCausalLM

    model = add_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), config.lora)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # non-zero B: both LoRA matrices get gradients from the first step
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


@pytest.mark.parametrize("aggregation", ["token_mean", "dr_grpo"])
def test_shard_weights_sum_to_one_for_equal_shards(aggregation):
    samples = [Sample([1] * 8, [0, 0, 1, 1, 1, 1, 1, 1], [0.0] * 8) for _ in range(4)]
    assert sum(shard_weight(samples[r::2], samples, aggregation) for r in range(2)) == pytest.approx(1.0)
    assert scored_tokens(samples[0]) == 6


def test_shard_weight_is_the_token_share():
    a = Sample([1] * 4, [0, 1, 1, 1], [0.0] * 4)  # 3 scored tokens
    b = Sample([1] * 8, [0, 0, 1, 1, 1, 1, 1, 1], [0.0] * 8)  # 6
    assert shard_weight([a], [a, b], "token_mean") == pytest.approx(3 / 9)
    assert shard_weight([a], [a, b], "seq_mean") == pytest.approx(1 / 2)
    assert shard_weight([a], [a, b], "dr_grpo") == pytest.approx(1 / 2 * 3 / 6)


@pytest.mark.slow
def test_a_resident_worker_group_of_two_matches_one_worker_step_after_step(tiny_model_dir, tmp_path):
    """Two chained updates on one worker group (started once, kept by the session) equal two in-process updates
    of one worker; the new weights come back through the object store with their hash checked on arrival."""
    import ray
    import torch

    from stages.policy.session import PolicySession, ShippedAdapter

    config = GRPOConfig(lr=1e-2, epochs=2, micro_batch_size=2, micro_batch_tokens=None, max_grad_norm=0.5,
                        activation_checkpointing=False)
    one = _policy(tiny_model_dir, config)
    two = copy.deepcopy(one)
    samples, advantages = _batch(one.config.vocab_size)
    before = {n: p.detach().clone() for n, p in one.named_parameters() if p.requires_grad}

    opt_one = torch.optim.AdamW([p for p in one.parameters() if p.requires_grad], lr=config.lr)
    opt_two = torch.optim.AdamW([p for p in two.parameters() if p.requires_grad], lr=config.lr)
    session = PolicySession()
    ctx = StageContext(Workspace.open(tmp_path / "ws"), session=session)
    steps = []
    try:
        for _ in range(2):
            expected = train_on_batch(one, opt_one, samples, advantages, config, temperature=1.0)
            got = train(two, opt_two, samples, advantages, config.model_copy(update={"workers": 2}), temperature=1.0,
                        ctx=ctx, base_model=str(tiny_model_dir))
            steps.append((expected, got))
        # What a rollout actor receives: the object rank 0 returned, checked against the hash it was sent with.
        ref, digest = got.stored
        assert ShippedAdapter(None, ref, digest).receive("p").state.keys() == ray.get(ref).keys()
        with pytest.raises(RuntimeError, match="arrived with sha256"):
            ShippedAdapter(None, ref, "0" * 64).receive("p")
        session.close()  # stops the group: its workers are gone
        pid = int(got.placements[0].split(":")[1])
        with pytest.raises(ProcessLookupError):
            for _ in range(100):  # ray.kill is asynchronous
                os.kill(pid, 0)
                time.sleep(0.1)
    finally:
        session.close()
        ray.shutdown()

    (_, first), (_, second) = steps
    assert first.placements == second.placements and len(first.placements) == 2  # one group, started once
    assert first.history[0]["update_group_start_seconds"] > 0 and second.history[0]["update_group_start_seconds"] == 0
    # where the second step's time went: rank 0's training is inside the ranks' calls, the group was the session's
    timing = second.history[0]
    assert 0 < timing["update_worker_train_s"] <= timing["update_calls_s"] and timing["update_group_get_s"] < 1.0
    assert all(timing[f"update_{k}_s"] >= 0 for k in ("pack", "put", "hold", "release", "fetch", "apply",
                                                        "worker_take", "worker_return"))
    after_one = dict(one.named_parameters())
    worst = max((p.detach() - after_one[n].detach()).abs().max().item()
                for n, p in two.named_parameters() if p.requires_grad)
    moved = max((after_one[n].detach() - b).abs().max().item() for n, b in before.items())
    assert moved > 100 * TOLERANCE  # the updates did something the comparison can see
    assert worst < TOLERANCE
    for expected, got in steps:
        assert len(got.history) == len(expected) == 2
        for g, e in zip(got.history, expected):
            assert g["grad_norm"] == pytest.approx(e["grad_norm"], rel=1e-5)  # the whole batch's gradient
            assert g["loss"] == pytest.approx(e["loss"], rel=1e-5, abs=1e-7)
            assert g["tokens"] == e["tokens"]
            assert g["ratio_mean"] == pytest.approx(e["ratio_mean"], rel=1e-5)
    # Adam's moments came back too: the next step continues from the same state.
    s_one, s_two = opt_one.state_dict()["state"], opt_two.state_dict()["state"]
    assert s_one.keys() == s_two.keys()
    assert all(torch.allclose(s_one[k]["exp_avg"], s_two[k]["exp_avg"], atol=1e-6) for k in s_one)
