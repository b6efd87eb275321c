"""The protocol edges of the policy service through the real client on uvicorn: the episode id in the
URL (/ep/{id}/v1), the field rule (honour, ignore harmlessly, or refuse with a 400 naming the field),
and OpenAI-style errors for unknown routes."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.scripted_model import QUESTION, SYSTEM, TOOLS
from tests.service_fixtures import client_of

pytestmark = pytest.mark.slow  # the scripted model (built once per run) and a service

OPENING = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


def test_the_episode_id_in_the_url_records_every_endpoint(served):
    client = client_of(served, base="/ep/ep-url/v1")  # a framework given only a base_url
    assert [m.id for m in client.models.list().data] == ["base"]
    first = client.chat.completions.create(model="base", messages=OPENING, tools=TOOLS, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = OPENING + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "d12: founded in 1987."}]
    list(client.chat.completions.create(model="base", messages=messages, tools=TOOLS, temperature=0, stream=True))
    client.completions.create(model="base", prompt="Vexhollow", max_tokens=2)
    log = served.recorder.peek("ep-url")
    assert log is not None and len(log.calls) == 3
    episode = httpx.get(f"{served.url}/rlops/episodes/ep-url").json()
    assert episode["num_turns"] == 3 and len(episode["segment_starts"]) == 1  # the completion is its own segment
    # The header still works, and the URL wins over it.
    client_of(served, "ep-header").chat.completions.create(model="base", messages=OPENING, max_tokens=2)
    assert len(served.recorder.peek("ep-header").calls) == 1
    client_of(served, "ep-header", base="/ep/ep-url2/v1").chat.completions.create(model="base", messages=OPENING,
                                                                                  max_tokens=2)
    assert len(served.recorder.peek("ep-url2").calls) == 1 and len(served.recorder.peek("ep-header").calls) == 1


@pytest.mark.parametrize("path, extra", [
    ("/v1/chat/completions", {"store": False, "metadata": {"run": "x"}, "parallel_tool_calls": True,
                              "service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "s",
                              "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "modalities": ["text"],
                              "tool_choice": "auto", "user": "u", "audio": None}),
    ("/v1/completions", {"echo": False, "best_of": 1, "store": True}),
])
def test_fields_that_change_nothing_are_accepted(served, path, extra):
    body = {"model": "base", "max_tokens": 2} | ({"messages": OPENING} if "chat" in path else {"prompt": "Hi"})
    r = httpx.post(served.url + path, json=body | extra, timeout=120)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path, field, value", [
    ("/v1/chat/completions", "logit_bias", {"42": 5}),
    ("/v1/chat/completions", "presence_penalty", 0.5),
    ("/v1/chat/completions", "frequency_penalty", -1),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "prediction", {"type": "content", "content": "x"}),
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "function_call", "auto"),
    ("/v1/completions", "tool_choice", "required"),  # honoured on chat and Responses (test_decoding.py)
    ("/v1/completions", "response_format", {"type": "json_object"}),
    ("/v1/chat/completions", "reasoning_effort", "high"),
    ("/v1/chat/completions", "top_k", 5),
    ("/v1/chat/completions", "made_up_field", 1),
    ("/v1/completions", "echo", True),
    ("/v1/completions", "suffix", "!"),
])
def test_fields_that_would_change_the_output_are_refused_by_name(served, path, field, value):
    body = {"model": "base", "max_tokens": 2} | ({"messages": OPENING} if "chat" in path else {"prompt": "Hi"})
    before = served.generate_calls
    r = httpx.post(served.url + path, json=body | {field: value}, timeout=120)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}: ")
    assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_parameter"
    assert served.generate_calls == before  # refused before any compute


def test_an_image_sent_to_a_text_policy_is_a_400_naming_the_problem(served):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]
    before = served.generate_calls
    r = httpx.post(f"{served.url}/v1/chat/completions", json={"model": "base", "messages": messages}, timeout=120)
    assert r.status_code == 400
    error = r.json()["error"]
    assert "image_url content parts need a vision-language policy" in error["message"]
    assert error["param"] == "messages.0.content" and error["type"] == "invalid_request_error"
    assert served.generate_calls == before  # refused before any compute


def test_the_openai_client_gets_refusals_as_bad_requests(served):
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client_of(served).chat.completions.create(model="base", messages=OPENING, logit_bias={"1": 3})


@pytest.mark.parametrize("method, path", [("GET", "/v2/nothing"), ("POST", "/v1/embeddings"),
                                          ("GET", "/v1/chat/completions")])
def test_unknown_routes_are_openai_style_errors(served, method, path):
    r = httpx.request(method, served.url + path, timeout=30)
    assert r.status_code in (404, 405)
    error = r.json()["error"]
    assert path in error["message"] and error["type"] == "invalid_request_error" and "detail" not in r.json()
    with pytest.raises(openai.NotFoundError):
        client_of(served).embeddings.create(model="base", input="x")
