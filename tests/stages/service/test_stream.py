"""Streaming on /v1/chat/completions and /v1/completions through the real `openai` client against uvicorn:
OpenAI's chunk format, deltas that add up to the non-streamed message, the same recording, tokens that
arrive while the batch is still generating, and errors.

The model is the tiny one of tests/scripted_model.py, so the tool call streamed here is real model output.
"""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from stages.service.stream import TokenFeed, settled
from tests.scripted_model import ANSWER, CALL, QUESTION, SYSTEM, TOOL_RESULT, TOOLS, script_messages
from tests.service_fixtures import broken_service, client_of

pytestmark = pytest.mark.slow  # the scripted model (built once per run) and a service


@pytest.fixture(scope="module")
def policy(scripted_policy):
    return scripted_policy


@pytest.fixture(scope="module")
def service(served):
    return served


_client = client_of


def _opening() -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


def _same_record(service, a: str, b: str) -> None:
    """Two episodes recorded the same tokens, log-probs and messages."""
    ca, cb = service.recorder.peek(a).calls, service.recorder.peek(b).calls
    assert len(ca) == len(cb)
    for x, y in zip(ca, cb):
        for p, q in zip(x.choices, y.choices, strict=True):
            assert (p.prompt_ids, p.token_ids, p.logprobs, p.finish_reason) == \
                   (q.prompt_ids, q.token_ids, q.logprobs, q.finish_reason)
            assert p.message.content == q.message.content
            assert [(c.name, c.arguments) for c in p.message.tool_calls] == \
                   [(c.name, c.arguments) for c in q.message.tool_calls]


def test_streamed_tool_call_is_openai_chunks_and_recorded_like_a_plain_call(service):
    ask = dict(model="base", messages=_opening(), tools=TOOLS, temperature=1.0, seed=11)
    plain = _client(service, "ep-plain").chat.completions.create(**ask)
    chunks = list(_client(service, "ep-stream").chat.completions.create(
        **ask, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.created and c.model == "base" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, finish, usage = chunks
    assert finish.choices[0].finish_reason == plain.choices[0].finish_reason == "tool_calls"
    assert finish.choices[0].delta.content is None and finish.choices[0].delta.tool_calls is None
    assert usage.choices == [] and usage.usage == plain.usage
    fragments = [t for c in body for t in c.choices[0].delta.tool_calls or []]
    assert all(f.index == 0 for f in fragments)
    assert [f.id for f in fragments if f.id] == [fragments[0].id] and fragments[0].function.name == CALL["name"]
    assert all(f.function.name is None for f in fragments[1:])
    arguments = "".join(f.function.arguments or "" for f in fragments)
    assert json.loads(arguments) == CALL["arguments"] == json.loads(plain.choices[0].message.tool_calls[0].function.arguments)
    content = "".join(c.choices[0].delta.content or "" for c in body)
    assert content == (plain.choices[0].message.content or "")
    _same_record(service, "ep-plain", "ep-stream")
    assert httpx.get(f"{service.url}/rlops/episodes/ep-stream").json()["token_ids"] == \
        httpx.get(f"{service.url}/rlops/episodes/ep-plain").json()["token_ids"]


def test_streamed_text_with_n_and_stop_strings_adds_up_to_the_plain_message(service):
    ask = dict(model="base", messages=[{"role": "user", "content": "Tell me a story."}], n=3, temperature=1.0,
               seed=5, max_tokens=24, logprobs=True)
    plain = _client(service, "ep-n-plain").chat.completions.create(**ask)
    chunks = list(_client(service, "ep-n-stream").chat.completions.create(**ask, stream=True))
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked
    for i, choice in enumerate(plain.choices):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert "".join(d.delta.content or "" for d in mine) == choice.message.content
        assert mine[-1].finish_reason == choice.finish_reason
        assert [e.logprob for e in mine[-1].logprobs.content] == [e.logprob for e in choice.logprobs.content]
    _same_record(service, "ep-n-plain", "ep-n-stream")

    # A stop string the model samples through ("1987" with stop "98"): "9" is held back until it is
    # known not to start "98", and nothing after the cut is ever sent.
    script = script_messages("call_x")
    messages = [{"role": "system", "content": SYSTEM}, script[1], {"role": "assistant", "content": script[2]["content"]},
                script[3]]
    stopped = list(_client(service).chat.completions.create(model="base", messages=messages, tools=TOOLS,
                                                            temperature=0, stop=["98"], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in stopped) == "1"
    assert stopped[-1].choices[0].finish_reason == "stop"


def test_streamed_completions_add_up_to_the_plain_ones(service):
    ask = dict(model="base", prompt=["Vexhollow Dynamics was", "Once upon"], n=2, max_tokens=6, seed=3,
               temperature=1.0)
    plain = _client(service, "ep-c-plain").completions.create(**ask)
    chunks = list(_client(service, "ep-c-stream").completions.create(**ask, stream=True,
                                                                     stream_options={"include_usage": True}))
    for choice in plain.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(m.text for m in mine) == choice.text and mine[-1].finish_reason == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    _same_record(service, "ep-c-plain", "ep-c-stream")


def test_tokens_reach_the_client_while_the_batch_still_generates(service, monkeypatch):
    """The batcher pauses after its 4th decoding step until the client has read a content chunk: with
    streaming that only sends the finished turn, the client would never see one in time."""
    client_saw_content = threading.Event()
    steps: list[int] = []
    waited: list[bool] = []
    feed_step = TokenFeed.on_step

    def counting(self, tokens):
        feed_step(self, tokens)
        steps.append(len(tokens))
        if len(steps) == 4:
            waited.append(client_saw_content.wait(timeout=60))

    monkeypatch.setattr(TokenFeed, "on_step", counting)
    stream = _client(service).chat.completions.create(
        model="base", messages=[{"role": "user", "content": "Say many words."}], max_tokens=30, temperature=1.0,
        seed=1, stream=True)
    at_first_content = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and at_first_content is None:
            at_first_content = len(steps)
            client_saw_content.set()
    assert waited == [True]
    assert at_first_content is not None and at_first_content < len(steps)


def test_openai_stream_helper_parses_the_stream_and_its_echo_continues_the_episode(service):
    client = _client(service, "ep-helper")
    messages = _opening()
    with client.chat.completions.stream(model="base", messages=messages, tools=TOOLS, temperature=0) as stream:
        first = stream.get_final_completion()
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == CALL["name"] and json.loads(call.function.arguments) == CALL["arguments"]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT}]
    with client.chat.completions.stream(model="base", messages=messages, tools=TOOLS, temperature=0) as stream:
        second = stream.get_final_completion()
    assert second.choices[0].message.content == ANSWER
    episode = httpx.get(f"{service.url}/rlops/episodes/ep-helper").json()
    assert episode["segment_starts"] == [] and episode["num_turns"] == 2


def test_errors_before_and_during_the_stream(service, policy):
    with pytest.raises(openai.NotFoundError):  # refused before streaming: an ordinary HTTP error
        list(_client(service).chat.completions.create(model="nope", messages=_opening(), stream=True))
    # An adapter that cannot be loaded fails inside generation, after the stream started: an error event.
    with broken_service(policy) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIError, match="adapter"):
            list(client.chat.completions.create(model="broken", messages=_opening(), stream=True))
        with pytest.raises(openai.APIError):
            list(client.completions.create(model="broken", prompt="hi", stream=True))


@pytest.mark.parametrize("text, stops, tools, expected", [
    ("Hello wor", [], False, "Hello wor"),
    ("Hello <tool_", [], True, "Hello"),
    ("Hello <tool_call>{\"na", [], True, "Hello"),
    ("  Hi there  ", [], True, "Hi there"),
    ("Hi  \n", [], False, "Hi  \n"),
    ("a 1 9", ["98"], False, "a 1 "),
    ("a 1 98 7", ["98"], False, "a 1 "),
    ("caf\ufffd", [], False, "caf"),
])
def test_settled_holds_back_what_could_still_change(text, stops, tools, expected):
    assert settled(text, stops, tools) == expected
