"""What agents ask of the sampler, through the real `openai` client against the service on 127.0.0.1:
top log-probs, `tool_choice` and `response_format` by constrained decoding, and loud refusals.

The model is the tiny random one (tests/conftest.py): it never writes a tool call or JSON by itself,
so every call and object in these answers is the constraint's doing.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from stages.policy.resident import ResidentPolicy
from stages.service.resolve import fixed_resolver
from stages.service.service import ServiceConfig
from tests.service_fixtures import client_of, serving

USER = [{"role": "user", "content": "Who founded Vexhollow Dynamics?"}]


@pytest.fixture(scope="module")
def service(tiny_model_dir: Path):
    with serving(ResidentPolicy.load(str(tiny_model_dir)), fixed_resolver("base", None),
                 ServiceConfig(default_max_tokens=48)) as svc:
        yield svc


_client = client_of


def test_top_logprobs_on_chat_and_completions(service):
    client = _client(service, "ep-top")
    r = client.chat.completions.create(model="base", messages=USER, max_tokens=5, logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        alts = [a.logprob for a in e.top_logprobs]
        assert len(alts) == 5 and alts == sorted(alts, reverse=True) and e.logprob <= alts[0] + 1e-6
        if e.token in [a.token for a in e.top_logprobs]:
            assert any(abs(a.logprob - e.logprob) < 1e-6 for a in e.top_logprobs if a.token == e.token)
        assert all(a.bytes == list(a.token.encode()) for a in e.top_logprobs)
    (call,) = service.recorder.peek("ep-top").calls
    assert call.choices[0].logprobs == [e.logprob for e in content]  # what was returned is what was recorded

    plain = client.chat.completions.create(model="base", messages=USER, max_tokens=3, logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)

    text = client.completions.create(model="base", prompt="Vexhollow Dynamics was", max_tokens=4, logprobs=3)
    lp = text.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) and all(len(t) == 3 for t in lp.top_logprobs)


@pytest.mark.parametrize("extra, field", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
def test_refusals_name_the_field(service, extra, field):
    r = httpx.post(service.url + "/v1/chat/completions", json={"model": "base", "messages": USER, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]
    assert httpx.post(service.url + "/v1/completions", json={"model": "base", "prompt": "a", "max_tokens": 1,
                                                             "logprobs": 21}, timeout=60).status_code == 400


TOOLS = [  # bounded arguments and no extra keys: a random model never closes a free string by itself
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 8}}, "required": ["query"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "read", "parameters": {
        "type": "object", "properties": {"doc_id": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["doc_id"], "additionalProperties": False}}},
]


def test_tool_choice_required_and_named_return_tool_calls(service):
    client = _client(service, "ep-req")
    r = client.chat.completions.create(model="base", messages=USER, tools=TOOLS, tool_choice="required", n=3,
                                       parallel_tool_calls=False, max_tokens=48)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.function.name in ("search", "read") and isinstance(json.loads(call.function.arguments), dict)
    named = client.chat.completions.create(model="base", messages=USER, tools=TOOLS, max_tokens=48,
                                           tool_choice={"type": "function", "function": {"name": "read"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "read" and 0 <= json.loads(call.function.arguments)["doc_id"] <= 99
    episode = httpx.get(f"{service.url}/rlops/episodes/ep-req", timeout=60).json()
    assert episode["constraints"] == ["tool_choice=required", "tool_choice=function:read"]

    free = client.chat.completions.create(model="base", messages=USER, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert free.choices[0].message.tool_calls is None
    assert free.usage.prompt_tokens < r.usage.prompt_tokens  # the tools were not offered


def test_a_required_call_cut_off_by_max_tokens_says_length(service):
    client = _client(service, "ep-cut")
    opened = 0
    for budget in (3, 8, 12, 16):  # cut before, at and after the opening tag: never "tool_calls"
        r = client.chat.completions.create(model="base", messages=USER, tools=TOOLS, tool_choice="required",
                                           max_tokens=budget)
        assert r.usage.completion_tokens == budget
        assert r.choices[0].finish_reason == "length"  # not "tool_calls": the call is unfinished
        opened += bool(r.choices[0].message.tool_calls)  # the half call is returned, as OpenAI returns it
        chunks = list(client.chat.completions.create(model="base", messages=USER, tools=TOOLS, tool_choice="required",
                                                     max_tokens=budget, stream=True))
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert opened  # some budget reached inside the call, the case that used to say "tool_calls"
    assert {c.choices[0].finish_reason for c in service.recorder.peek("ep-cut").calls} == {"length"}


def test_responses_tool_choice_is_honoured_like_chat(service):
    client = _client(service, "ep-resp-req")
    flat = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses shape
    r = client.responses.create(model="base", input="Who founded Vexhollow Dynamics?", tools=flat,
                                tool_choice={"type": "function", "name": "read"}, max_output_tokens=48)
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "read" and 0 <= json.loads(call.arguments)["doc_id"] <= 99
    episode = httpx.get(f"{service.url}/rlops/episodes/ep-resp-req", timeout=60).json()
    assert episode["constraints"] == ["tool_choice=function:read"]


def test_response_format_returns_json(service):
    client = _client(service)
    schema = {"type": "object", "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
              "required": ["year"], "additionalProperties": False}
    r = client.chat.completions.create(model="base", messages=USER, max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "Answer", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    assert 1900 <= json.loads(r.choices[0].message.content)["year"] <= 2100
    r = client.chat.completions.create(model="base", messages=USER, max_tokens=40, temperature=0,
                                       response_format={"type": "json_object"})
    content = r.choices[0].message.content  # any object: a random model may run out of tokens inside a string
    assert content.startswith("{") and (r.choices[0].finish_reason == "length" or isinstance(json.loads(content), dict))


@pytest.mark.parametrize("extra, field", [
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "A"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "A", "schema": {"type": "nothing"}}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string", "pattern": "(?=x)"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_constraint_refusals_name_the_field(service, extra, field):
    r = httpx.post(service.url + "/v1/chat/completions", json={"model": "base", "messages": USER, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(field + ":"), r.text


def test_pydantic_ai_structured_output_tool_and_native(service):
    """pydantic-ai's two structured-output modes complete against the service: the tool mode sends
    `tool_choice: "required"` with a `final_result` tool, NativeOutput a strict json_schema."""
    import asyncio
    from typing import Literal

    from pydantic import BaseModel, Field
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Answer(BaseModel):
        city: Literal["Paris", "Rome", "Oslo"]
        year: int = Field(ge=1900, le=2100)

    async def run(output_type):
        client = openai.AsyncOpenAI(base_url=service.url + "/v1", api_key="unused", max_retries=0)
        model = OpenAIChatModel("base", provider=OpenAIProvider(openai_client=client))
        agent = Agent(model, output_type=output_type, instructions="Answer with the city and the year.")
        try:
            return (await agent.run("Where and when was Vexhollow Dynamics founded?",
                                    model_settings={"max_tokens": 48})).output
        finally:
            await client.close()

    for output_type in (Answer, NativeOutput(Answer)):
        out = asyncio.run(run(output_type))
        assert isinstance(out, Answer) and 1900 <= out.year <= 2100
