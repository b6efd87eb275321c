"""Multi-worker GRPO (Ray Train DDP, gloo on CPU) gives the update of one worker."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from stages.common import StageContext
from stages.policy.lora import add_lora
from stages.update.config import GRPOConfig
from stages.update.data import Sample
from stages.update.train import train_on_batch
from stages.update.workers import scored_tokens, shard_weight, train
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
def test_two_ddp_workers_match_one_worker(tiny_model_dir, tmp_path):
    import ray
    import torch

    config = GRPOConfig(lr=1e-2, epochs=2, micro_batch_size=2, micro_batch_tokens=None, max_grad_norm=0.5,
                        activation_checkpointing=False)
    one = _policy(tiny_model_dir, config)
    two = copy.deepcopy(one)
    samples, advantages = _batch(one.config.vocab_size)
    before = {n: p.detach().clone() for n, p in one.named_parameters() if p.requires_grad}

    opt_one = torch.optim.AdamW([p for p in one.parameters() if p.requires_grad], lr=config.lr)
    expected = train_on_batch(one, opt_one, samples, advantages, config, temperature=1.0)

    opt_two = torch.optim.AdamW([p for p in two.parameters() if p.requires_grad], lr=config.lr)
    ctx = StageContext(Workspace.open(tmp_path / "ws"))
    try:
        got = train(two, opt_two, samples, advantages, config.model_copy(update={"workers": 2}), temperature=1.0,
                    ctx=ctx, base_model=str(tiny_model_dir))
    finally:
        ray.shutdown()

    after_one = dict(one.named_parameters())
    worst = max((p.detach() - after_one[n].detach()).abs().max().item()
                for n, p in two.named_parameters() if p.requires_grad)
    moved = max((after_one[n].detach() - b).abs().max().item() for n, b in before.items())
    assert moved > 100 * TOLERANCE  # the update did something the comparison can see
    assert worst < TOLERANCE
    assert len(got) == len(expected) == 2
    for g, e in zip(got, expected):
        assert g["grad_norm"] == pytest.approx(e["grad_norm"], rel=1e-5)  # the whole batch's gradient
        assert g["loss"] == pytest.approx(e["loss"], rel=1e-5, abs=1e-7)
        assert g["tokens"] == e["tokens"]
        assert g["ratio_mean"] == pytest.approx(e["ratio_mean"], rel=1e-5)
    # Adam's moments came back too: the next step continues from the same state.
    s_one, s_two = opt_one.state_dict()["state"], opt_two.state_dict()["state"]
    assert s_one.keys() == s_two.keys()
    assert all(torch.allclose(s_one[k]["exp_avg"], s_two[k]["exp_avg"], atol=1e-6) for k in s_one)
