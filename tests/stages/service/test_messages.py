"""Anthropic's Messages API (`POST /v1/messages`) through the real `anthropic` SDK against the real app on
uvicorn over the scripted tiny model: a tool-using episode with `messages.create` and `messages.stream`
recorded as one segment, the streamed event sequence and record, stop reasons, count_tokens, and errors in
Anthropic's shape (a prompt over the context among them, nothing recorded)."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.scripted_model import ANSWER, CALL, QUESTION, SYSTEM, TOOL_RESULT, TOOLS
from tests.stages.service.test_stream import _same_record

pytestmark = pytest.mark.slow  # the scripted model (built once per run) and a service

# The scripted tool in Anthropic's shape. SDK 2.10 takes no temperature argument: it goes in extra_body,
# as older SDKs send it (greedy, so the scripted turns come back).
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
GREEDY = {"extra_body": {"temperature": 0}}
ASK = dict(model="base", max_tokens=40, system=SYSTEM, tools=ANTHROPIC_TOOLS, **GREEDY)


def _client(served, episode: str | None = None) -> anthropic.Anthropic:
    headers = {"X-Episode-Id": episode} if episode else {}
    return anthropic.Anthropic(base_url=served.url, api_key="unused", default_headers=headers, max_retries=0)


def _episode(served, episode_id: str) -> httpx.Response:
    return httpx.get(f"{served.url}/rlops/episodes/{episode_id}")


def _result_turn(first) -> dict:  # noqa: ANN001 - the SDK's Message
    (use,) = [b for b in first.content if b.type == "tool_use"]
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": TOOL_RESULT}]}


def test_messages_create_runs_a_tool_using_episode_as_one_segment(served):
    client = _client(served)
    question = [{"role": "user", "content": QUESTION}]
    # The episode named by metadata.user_id: neither the URL nor a header names one.
    first = client.messages.create(messages=question, metadata={"user_id": "ep-msg"}, **ASK)
    assert first.type == "message" and first.id.startswith("msg_") and first.stop_reason == "tool_use"
    (use,) = first.content
    assert use.type == "tool_use" and use.name == CALL["name"] and use.input == CALL["arguments"]
    # The SDK's own content blocks sent back as the assistant turn, as its docs' tool loop does.
    second = client.messages.create(messages=question + [{"role": "assistant", "content": first.content},
                                                         _result_turn(first)],
                                    metadata={"user_id": "ep-msg"}, **ASK)
    assert second.stop_reason == "end_turn" and [b.type for b in second.content] == ["text"]
    assert second.content[0].text == ANSWER
    episode = _episode(served, "ep-msg").json()
    assert episode["segment_starts"] == [] and episode["num_turns"] == 2
    assert sum(episode["loss_mask"]) == first.usage.output_tokens + second.usage.output_tokens
    assert episode["messages"][-2] == {"role": "tool", "content": TOOL_RESULT, "tool_call_id": use.id}

    # The same exchange counted: count_tokens gives the input tokens create reports.
    counted = client.messages.count_tokens(model="base", system=SYSTEM, tools=ANTHROPIC_TOOLS, messages=question)
    assert counted.input_tokens == first.usage.input_tokens


def test_messages_stream_sends_anthropics_events_and_records_as_create(served):
    question = [{"role": "user", "content": QUESTION}]
    plain = _client(served, "ep-msg-plain")
    first = plain.messages.create(messages=question, **ASK)
    second = plain.messages.create(messages=question + [{"role": "assistant", "content": first.content},
                                                        _result_turn(first)], **ASK)

    streamed = _client(served, "ep-msg-stream")
    with streamed.messages.stream(messages=question, **ASK) as stream:
        kinds = [e.type for e in stream]
        s_first = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert ["content_block_start", "content_block_delta", "content_block_stop"] == \
        [k for k in kinds if k.startswith("content_block")]
    def meaning(message):  # noqa: ANN001, ANN202 - the call ids differ per response
        return [b.model_dump(exclude={"id"}) for b in message.content], message.stop_reason, message.usage

    assert meaning(s_first) == meaning(first) and s_first.stop_reason == "tool_use"
    with streamed.messages.stream(messages=question + [{"role": "assistant", "content": s_first.content},
                                                      _result_turn(s_first)], **ASK) as stream:
        text = "".join(stream.text_stream)
        s_second = stream.get_final_message()
    assert text == s_second.content[0].text == ANSWER and s_second.stop_reason == "end_turn"
    assert s_second.usage.output_tokens == second.usage.output_tokens
    _same_record(served, "ep-msg-plain", "ep-msg-stream")
    episode = _episode(served, "ep-msg-stream").json()
    assert episode["segment_starts"] == []
    assert sum(episode["loss_mask"]) == s_first.usage.output_tokens + s_second.usage.output_tokens


def test_the_raw_event_stream_is_anthropics_sequence(served):
    body = {"model": "base", "max_tokens": 40, "system": SYSTEM, "tools": ANTHROPIC_TOOLS, "stream": True,
            "temperature": 0, "messages": [{"role": "user", "content": QUESTION}]}
    with httpx.stream("POST", f"{served.url}/v1/messages", json=body, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line]
    pairs = list(zip(lines[::2], lines[1::2]))
    assert all(e.startswith("event: ") and d.startswith("data: ") for e, d in pairs)
    events = [json.loads(d[6:]) for _, d in pairs]
    assert [e.split(": ")[1] for e, _ in pairs] == [e["type"] for e in events]
    start, block, delta, stop, message_delta, _ = events
    assert start["message"]["usage"]["input_tokens"] > 0 and start["message"]["content"] == []
    assert block["content_block"] == {"type": "tool_use", "id": block["content_block"]["id"], "name": "search",
                                      "input": {}}
    assert delta["delta"]["type"] == "input_json_delta"
    assert json.loads(delta["delta"]["partial_json"]) == CALL["arguments"] and stop["index"] == 0
    assert message_delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_stop_sequences_tool_choice_and_thinking_blocks(served):
    client = _client(served)
    done = [{"role": "user", "content": QUESTION},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "look it up", "signature": "x"},
                                              {"type": "tool_use", "id": "toolu_1", "name": "search",
                                               "input": CALL["arguments"]}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": TOOL_RESULT}]}]
    cut = client.messages.create(messages=done, stop_sequences=["98"], **ASK)
    assert (cut.stop_reason, cut.stop_sequence, cut.content[0].text) == ("stop_sequence", "98", ANSWER[:ANSWER.find("98")])
    short = client.messages.create(messages=done, **ASK | {"max_tokens": 1})
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 1
    # Honoured by constrained decoding (recorded as such): the model's own call, under a grammar.
    forced = client.messages.create(messages=[{"role": "user", "content": QUESTION}], metadata={"user_id": "ep-forced"},
                                    tool_choice={"type": "tool", "name": "search"}, **ASK)
    assert forced.stop_reason == "tool_use" and forced.content[-1].input == CALL["arguments"]
    assert _episode(served, "ep-forced").json()["constraints"] == ["tool_choice=function:search"]
    none = client.messages.create(messages=[{"role": "user", "content": QUESTION}], tool_choice={"type": "none"}, **ASK)
    assert all(b.type == "text" for b in none.content) and none.stop_reason in ("end_turn", "max_tokens")


@pytest.mark.parametrize(("extra", "error", "words"), [
    ({"model": "nope"}, anthropic.NotFoundError, "nope"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, anthropic.BadRequestError, "thinking"),
    ({"extra_body": {"top_k": 5}}, anthropic.BadRequestError, "top_k"),
    ({"extra_body": {"container": "c1"}}, anthropic.BadRequestError, "container"),
    ({"output_config": {"effort": "low"}}, anthropic.BadRequestError, "output_config"),
    ({"tool_choice": {"type": "tool", "name": "read"}}, anthropic.BadRequestError, "read"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, anthropic.BadRequestError,
     "image"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}]},
     anthropic.BadRequestError, "prefill"),
])
def test_refused_requests_are_anthropic_errors(served, extra, error, words):
    ask = dict(ASK, messages=[{"role": "user", "content": "hi"}]) | extra
    if "extra_body" in extra:
        ask["extra_body"] = GREEDY["extra_body"] | extra["extra_body"]
    with pytest.raises(error, match=words) as caught:
        _client(served, "ep-msg-refused").messages.create(**ask)
    body = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == \
        ("not_found_error" if error is anthropic.NotFoundError else "invalid_request_error")
    # Harmless fields are ignored: thinking disabled, the default effort, caching and routing hints.
    assert _client(served).messages.create(messages=[{"role": "user", "content": "hi"}], thinking={"type": "disabled"},
                                           output_config={"effort": "high"}, service_tier="auto",
                                           **ASK | {"max_tokens": 2}).usage.output_tokens <= 2


def test_over_the_context_is_an_invalid_request_naming_both_lengths_and_records_nothing(served):
    client = _client(served, "ep-msg-long")
    with pytest.raises(anthropic.BadRequestError, match=r"the prompt has \d+ tokens; the limit is 2048") as caught:
        client.messages.create(model="base", max_tokens=8, messages=[{"role": "user", "content": "word " * 3000}])
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert _episode(served, "ep-msg-long").status_code == 404  # nothing recorded as sampled
    r = httpx.post(f"{served.url}/v1/messages", json={"model": "base", "messages": [{"role": "user", "content": "q"}]})
    assert r.status_code == 400 and r.json()["error"] == {"type": "invalid_request_error",
                                                          "message": "max_tokens: Field required"}
    r = httpx.get(f"{served.url}/ep/x/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"


def test_a_failure_during_a_streamed_message_ends_it_with_an_error_event(scripted_policy):
    from stages.service.app import ServerThread, build_app
    from stages.service.resolve import fixed_resolver
    from stages.service.service import PolicyService, ServiceConfig

    resolve, names = fixed_resolver("broken", "/nonexistent/adapter")  # fails inside generation
    broken = PolicyService(scripted_policy, resolve, ServiceConfig(batch_window_s=0.0), names)
    body = {"model": "broken", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with ServerThread(build_app(broken)) as url:
        with httpx.stream("POST", f"{url}/v1/messages", json=body, timeout=120) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200 and [e["type"] for e in events] == ["message_start", "error"]
        assert events[-1]["error"]["type"] == "api_error"
        r = httpx.post(f"{url}/v1/messages", json=body | {"model": "nope"}, timeout=60)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"  # refused before streaming
    broken.close()
