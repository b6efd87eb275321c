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
from stages.service.app import ServerThread, build_app
from stages.service.resolve import fixed_resolver
from stages.service.service import PolicyService, ServiceConfig

USER = [{"role": "user", "content": "Who founded Vexhollow Dynamics?"}]


@pytest.fixture(scope="module")
def service(tiny_model_dir: Path):
    policy = ResidentPolicy.load(str(tiny_model_dir))
    resolve, names = fixed_resolver("base", None)
    svc = PolicyService(policy, resolve, ServiceConfig(default_max_tokens=48), names)
    with ServerThread(build_app(svc)) as url:
        svc.url = url
        yield svc
    svc.close()


def _client(service, episode: str | None = None) -> openai.OpenAI:
    headers = {"X-Episode-Id": episode} if episode else {}
    return openai.OpenAI(base_url=service.url + "/v1", api_key="unused", default_headers=headers, max_retries=0)


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
