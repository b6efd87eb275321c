"""The policy service on vLLM (`rlops serve --backend vllm`), vLLM's CPU wheel under the real app on uvicorn, with
the real `openai` and `anthropic` clients: chat completions plain and streamed (the same record), a multi-turn
episode recorded as one segment whose behaviour log-probs the trainer reproduces, `tool_choice: required` and a
JSON schema through vLLM's structured outputs, `top_logprobs`, the Responses and Messages APIs, and the adapter
of a named checkpoint. The engine is the session's one (`vllm_backend`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import torch

from stages.policy.resident import ResidentPolicy
from stages.service.resolve import fixed_resolver
from stages.service.service import ServiceConfig
from tests.service_fixtures import client_of, serving
from tests.stages.policy.test_vllm import _adapter, _recomputed

pytestmark = [pytest.mark.xdist_group("vllm"), pytest.mark.slow]

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a record up by id.",
    "parameters": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["id"], "additionalProperties": False}}}]
OPENING = [{"role": "system", "content": "You look records up."}, {"role": "user", "content": "Find record 7."}]


@pytest.fixture(scope="module")
def adapter(vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    return _adapter(vllm_model_dir, tmp_path_factory.mktemp("served-adapter") / "ck", seed=7)


@pytest.fixture(scope="module")
def served(vllm_backend: Any, tokenizer: Any, adapter: str) -> Any:
    policy = ResidentPolicy(vllm_backend, vllm_backend.tokenizer, engine="vllm")
    with serving(policy, fixed_resolver("ck-test", adapter), ServiceConfig(batch_window_s=0.05, default_max_tokens=24)) as svc:
        yield svc


def _episode(served: Any, episode: str) -> dict[str, Any]:
    return httpx.get(f"{served.url}/rlops/episodes/{episode}", timeout=30).json()


def test_chat_plain_and_streamed_record_the_same_tokens_the_trainer_reproduces(served: Any, vllm_model_dir: Path,
                                                                               adapter: str) -> None:
    ask = dict(model="ck-test", messages=OPENING, temperature=1.0, seed=3, max_tokens=16)
    plain = client_of(served, "ep-plain").chat.completions.create(**ask)
    chunks = list(client_of(served, "ep-stream").chat.completions.create(**ask, stream=True,
                                                                          stream_options={"include_usage": True}))
    *body, finish, usage = chunks
    assert "".join(c.choices[0].delta.content or "" for c in body) == (plain.choices[0].message.content or "")
    assert finish.choices[0].finish_reason == plain.choices[0].finish_reason and usage.usage == plain.usage
    a, b = _episode(served, "ep-plain"), _episode(served, "ep-stream")
    assert a["token_ids"] == b["token_ids"] and a["behavior_logprobs"] == b["behavior_logprobs"]
    # The recorded log-probs are the checkpoint's (its adapter through vLLM's LoRARequest), as the update sees them.
    start = a["loss_mask"].index(1)
    want = _recomputed(vllm_model_dir, adapter, a["token_ids"][:start], a["token_ids"][start:], 1.0)
    assert float((torch.tensor(a["behavior_logprobs"][start:]) - want).abs().max()) < 1e-3


def test_a_required_tool_call_then_its_result_is_one_segment(served: Any) -> None:
    client = client_of(served, "ep-tools")
    first = client.chat.completions.create(model="ck-test", messages=OPENING, tools=TOOLS, tool_choice="required",
                                           seed=1, max_tokens=40)
    (call,) = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "lookup"
    assert 0 <= json.loads(call.function.arguments)["id"] <= 99
    turn = [first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "record 7: a lamp"}]
    second = client.chat.completions.create(model="ck-test", messages=OPENING + turn, tools=TOOLS, seed=2,
                                            max_tokens=12, logprobs=True, top_logprobs=2)
    steps = second.choices[0].logprobs.content
    assert steps and all(len(s.top_logprobs) == 2 and s.logprob <= s.top_logprobs[0].logprob + 1e-6 for s in steps)
    episode = _episode(served, "ep-tools")
    assert episode["segment_starts"] == [] and episode["num_turns"] == 2


def test_json_schema_responses_and_messages_on_vllm(served: Any) -> None:
    schema = {"type": "object", "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
              "required": ["year"], "additionalProperties": False}
    shaped = client_of(served).chat.completions.create(
        model="ck-test", messages=OPENING, seed=4, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert 1900 <= json.loads(shaped.choices[0].message.content)["year"] <= 2100
    response = client_of(served, "ep-resp").responses.create(model="ck-test", input="Find record 7.",
                                                              max_output_tokens=12)
    assert response.status in {"completed", "incomplete"} and _episode(served, "ep-resp")["num_turns"] == 1
    streamed = list(client_of(served, "ep-resp-s").responses.create(model="ck-test", input="Find record 7.",
                                                                    max_output_tokens=12, stream=True))
    assert streamed[-1].type in {"response.completed", "response.incomplete"}
    messages = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0,
                                   default_headers={"X-Episode-Id": "ep-msg"})
    message = messages.messages.create(model="ck-test", max_tokens=12, messages=[{"role": "user", "content": "Hi."}])
    assert message.type == "message" and message.usage.output_tokens == sum(_episode(served, "ep-msg")["loss_mask"])
    with messages.messages.stream(model="ck-test", max_tokens=12, messages=[{"role": "user", "content": "Hi."}]) as s:
        final = s.get_final_message()
    assert final.stop_reason in {"end_turn", "max_tokens"}
