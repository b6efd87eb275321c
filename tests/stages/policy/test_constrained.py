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


# Bounded strings and numbers, no extra keys: a random model never closes a free string (or key) by itself.
TOOLS = [
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 6}}, "required": ["query"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "read", "parameters": {
        "type": "object", "properties": {"doc_id": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "full": {"type": "boolean"}}, "required": ["doc_id", "full"], "additionalProperties": False}}},
]
ANSWER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                           "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
          "required": ["city", "year"], "additionalProperties": False}


def _schema(name: str) -> dict[str, Any]:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("only", [None, "read"])
def test_required_tool_choice_always_gives_a_valid_call(policy: tuple[Any, Any], seed: int, only: str | None) -> None:
    import jsonschema

    from stages.policy.constrain import tool_call_constraint
    from tasks.base import parse_tool_calls

    model, tokenizer = policy
    backend = HFBackend(model, tokenizer)
    c = tool_call_constraint(TOOLS, only=only, parallel=False, label="tool_choice=required")
    samples = backend.generate(prompts(tokenizer), SamplingConfig(max_new_tokens=64), seed=seed,
                               rows=[RowOptions(constraint=c)] * 3)
    for s in samples:
        assert s.finish_reason == "stop" and s.token_ids[-1] in backend.eos_ids and s.error is None, s.text
        assert s.constraint == "tool_choice=required"
        (call,) = parse_tool_calls(s.text, 0)
        assert call.name in ([only] if only else ["search", "read"])
        jsonschema.validate(json.loads(call.arguments), _schema(call.name))


def test_json_schema_output_parses_and_validates(policy: tuple[Any, Any]) -> None:
    import jsonschema

    from stages.policy.constrain import json_constraint

    model, tokenizer = policy
    c = json_constraint(ANSWER, "response_format=json_schema")
    for seed in (0, 1):
        for s in HFBackend(model, tokenizer).generate(prompts(tokenizer), SamplingConfig(max_new_tokens=48), seed=seed,
                                                      rows=[RowOptions(constraint=c)] * 3):
            assert s.finish_reason == "stop", s.text
            jsonschema.validate(json.loads(s.text), ANSWER)


def _masked_logprobs(model: Any, tokenizer: Any, prefix: list[int], tokens: list[int], lark: str,
                     temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax((logits with the grammar's disallowed tokens at -inf) / T) recomputed independently: a
    separate forward pass and a fresh llguidance matcher replaying the sampled tokens. (n,) and (n, V)"""
    import llguidance
    import llguidance.hf
    import numpy as np

    ll = llguidance.hf.from_tokenizer(tokenizer, eos_token=tokenizer.eos_token_id)
    m = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(lark))
    logits = next_token_logits(model, prefix, tokens)  # (n, V)
    for step, token in enumerate(tokens):
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[: logits.shape[1]].astype(bool))
        logits[step, ~allowed] = float("-inf")
        assert m.consume_token(token)
    full = torch.log_softmax(logits / temperature, dim=-1)
    return full.gather(1, torch.tensor(tokens)[:, None]).squeeze(1), full


def test_constrained_and_free_rows_share_a_call_and_log_probs_are_the_masked_ones(policy: tuple[Any, Any]) -> None:
    from stages.policy.constrain import tool_call_constraint

    model, tokenizer = policy
    backend, batch, sampling = HFBackend(model, tokenizer), prompts(tokenizer), SamplingConfig(0.8, max_new_tokens=40)
    c = tool_call_constraint(TOOLS, only=None, parallel=True, label="tool_choice=required")
    mixed = backend.generate(batch, sampling, seed=5, rows=[RowOptions(constraint=c), RowOptions(),
                                                            RowOptions(top_logprobs=4, constraint=c)])
    free = backend.generate(batch, sampling, seed=5)
    assert mixed[1].token_ids == free[1].token_ids and mixed[1].logprobs == free[1].logprobs
    assert mixed[1].constraint is None and mixed[0].token_ids != free[0].token_ids
    for row in (0, 2):
        s = mixed[row]
        expected, full = _masked_logprobs(model, tokenizer, batch[row], s.token_ids, c.lark, 0.8)
        assert torch.allclose(torch.tensor(s.logprobs), expected, atol=1e-4)
        unmasked = torch.log_softmax(next_token_logits(model, batch[row], s.token_ids) / 0.8, dim=-1)
        assert (expected >= unmasked.gather(1, torch.tensor(s.token_ids)[:, None]).squeeze(1) - 1e-5).all()
    for step, top in enumerate(mixed[2].top_logprobs):  # alternatives from the masked distribution only
        allowed = int(torch.isfinite(full[step]).sum())
        assert len(top) == min(4, allowed) and all(torch.isfinite(full[step, t]) for t, _ in top)
