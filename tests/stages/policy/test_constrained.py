"""Per-row options of HFBackend.generate on a tiny random Llama: top log-probs, and grammar-constrained
rows (llguidance) batched with free ones; recorded log-probs checked against a separate forward pass."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from stages.policy.hf import HFBackend
from stages.policy.load import load_policy
from stages.policy.sampling import RowOptions, SamplingConfig
from tests.stages.policy.test_hf import next_token_logits, prompts


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path) -> tuple[Any, Any]:
    return load_policy(str(tiny_model_dir))


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_top_logprobs_are_the_k_best_of_the_sampled_distribution(policy: tuple[Any, Any], temperature: float) -> None:
    model, tokenizer = policy
    batch = prompts(tokenizer)
    ks = [5, 0, 20]  # a row that asks nothing gets nothing
    samples = HFBackend(model, tokenizer).generate(batch, SamplingConfig(temperature, max_new_tokens=6), seed=4,
                                                   rows=[RowOptions(top_logprobs=k) for k in ks])
    plain = HFBackend(model, tokenizer).generate(batch, SamplingConfig(temperature, max_new_tokens=6), seed=4)
    assert [s.token_ids for s in samples] == [s.token_ids for s in plain]  # asking changes no draw
    assert samples[1].top_logprobs is None
    for prefix, s, k in zip(batch, samples, ks):
        if not k:
            continue
        fresh = torch.log_softmax(next_token_logits(model, prefix, s.token_ids) / (temperature or 1.0), dim=-1)
        assert len(s.top_logprobs) == len(s.token_ids)
        for step, (token, lp, top) in enumerate(zip(s.token_ids, s.logprobs, s.top_logprobs)):
            ids, lps = [t for t, _ in top], [v for _, v in top]
            assert len(top) == k and lps == sorted(lps, reverse=True)
            best = fresh[step].topk(k)
            assert torch.allclose(torch.tensor(lps), best.values, atol=1e-4)
            assert set(ids) == set(best.indices.tolist()) or len(set(best.values.tolist())) < k  # ties
            if token in ids:
                assert abs(lps[ids.index(token)] - lp) < 1e-5
            else:
                assert lp <= lps[-1] + 1e-6

