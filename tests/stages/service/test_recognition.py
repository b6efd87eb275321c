"""Turn recognition by meaning: every framework's echo of the service's own tool-call turn (captured
from the real frameworks against a scripted server, tests/stages/service/framework_echoes.json)
continues the episode in one segment; a really edited turn starts a new segment that renders its tool
calls as the model writes them. Real SmolLM2 tokenizer and chat template, no model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages.policy.chat import ChatFormat
from stages.service.recorder import Call, Completion, EpisodeLog, assemble, chat_prompt
from stages.service.schemas import ChatMessage
from storage.schema import Message, ToolCall

ECHOES = json.loads((Path(__file__).parent / "framework_echoes.json").read_text())
RETURNED = ECHOES["returned"]  # what the scripted server returned: call_abc123, search, arguments per variant
OPENING = [Message("system", "You search."), Message("user", "Where was Grougo Ninael born?")]
# LangGraph's streamed parser repairs cut-off arguments (`{"query": "Grougo Ninael"` comes back closed):
# the tool ran with arguments the model did not write, so the turn did change. smolagents sends the
# call back as its own text ("Calling tools: [...]"), never as a tool call: recognised from that text.
CHANGED = {"bad__langgraph_agent.rollout_stream"}


def _served_call(tokenizer, arguments: str, content: str | None = None):
    """An episode whose first call returned a `search` tool call (as the scripted server did)."""
    chat = ChatFormat(tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    log = EpisodeLog()
    prompt, seen = chat_prompt(chat, OPENING, log, {eos})
    raw = (content or "") + f'<tool_call>{{"name": "search", "arguments": {arguments}}}</tool_call>'
    sampled = chat.encode(raw) + [eos]
    calls = [ToolCall(RETURNED["id"], RETURNED["name"], arguments)]
    log.add(Call(seen, [Completion(prompt, sampled, [-0.5] * len(sampled), Message("assistant", raw, calls), "stop")]),
            [Message("assistant", content, calls)])
    return chat, log, eos


def _continue(chat, log, eos, echo: dict) -> list[Message]:
    """The framework's second call: its echo of the turn, the tool's result; returns what the model saw."""
    messages = OPENING + [ChatMessage.model_validate(echo).to_message(),
                          Message("tool", "born in Vexhollow", tool_call_id=RETURNED["id"])]
    prompt, seen = chat_prompt(chat, messages, log, {eos})
    log.add(Call(seen, [Completion(prompt, [42, eos], [-0.1, -0.2], Message("assistant", "Vexhollow"), "stop")]), [])
    return seen


@pytest.mark.parametrize("name", sorted(ECHOES["chat"]))
def test_each_frameworks_echo_of_the_tool_call_continues_the_episode(tokenizer, name):
    chat, log, eos = _served_call(tokenizer, RETURNED["arguments"][name.split("__")[0]])
    _continue(chat, log, eos, ECHOES["chat"][name])
    t = assemble(log)
    if name in CHANGED:
        assert len(t.segment_starts) == 1
    else:
        assert t.segment_starts == [], f"{name}: {ECHOES['chat'][name]}"
        sampled = log.calls[0].choices[0].token_ids
        assert t.token_ids[: len(log.calls[0].choices[0].prompt_ids) + len(sampled)] == \
            log.calls[0].choices[0].prompt_ids + sampled  # the first turn's tokens as sampled


@pytest.mark.parametrize("echo", [
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_abc123", "type": "function", "index": 0,
                                                         "function": {"name": "search", "arguments": '{"query":"Q"}'}}]},
    {"role": "assistant", "content": [{"type": "text", "text": ""}], "refusal": None, "annotations": [],
     "tool_calls": [{"id": "call_abc123", "function": {"name": "search", "arguments": '{\n  "query": "Q"\n}'}}]},
])
def test_empty_content_forms_and_extra_keys_are_the_same_turn(tokenizer, echo):
    chat, log, eos = _served_call(tokenizer, '{"query": "Q"}')
    _continue(chat, log, eos, echo)
    assert assemble(log).segment_starts == []


def test_text_before_the_call_is_part_of_the_turn(tokenizer):
    chat, log, eos = _served_call(tokenizer, '{"query": "Q"}', content="Let me look.")
    call = {"id": "call_abc123", "type": "function", "function": {"name": "search", "arguments": '{"query": "Q"}'}}
    _continue(chat, log, eos, {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}],
                               "tool_calls": [call]})
    assert assemble(log).segment_starts == []
    # The model's own text edited: a new turn, rendered with its text and its call.
    chat, log, eos = _served_call(tokenizer, '{"query": "Q"}', content="Let me look.")
    seen = _continue(chat, log, eos, {"role": "assistant", "content": "I will look.", "tool_calls": [call]})
    assert len(assemble(log).segment_starts) == 1
    assert seen[2].content == 'I will look.\n<tool_call>{"name": "search", "arguments": {"query": "Q"}}</tool_call>'


@pytest.mark.parametrize("arguments, written", [
    ('{"query": "edited"}', '<tool_call>{"name": "search", "arguments": {"query": "edited"}}</tool_call>'),
    ('{"query": "cut', '<tool_call>{"name": "search", "arguments": {"query": "cut}</tool_call>'),
])
def test_an_edited_call_starts_a_new_segment_that_keeps_the_call(tokenizer, arguments, written):
    chat, log, eos = _served_call(tokenizer, '{"query": "Q"}')
    echo = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "call_abc123", "type": "function", "function": {"name": "search", "arguments": arguments}}]}
    _continue(chat, log, eos, echo)
    t = assemble(log)
    (start,) = t.segment_starts
    assert written in tokenizer.decode(t.token_ids[start:])
    assert sum(t.loss_mask) == len(log.calls[0].choices[0].token_ids) + 2  # each sampled token once


@pytest.mark.parametrize("text, recognised", [
    ("Calling tools:\n[{'id': 'call_abc123', 'type': 'function', 'function': {'name': 'search', 'arguments': {'query': 'Q'}}}]", True),
    ("\nCalling tools:\n[{'id': 'call_abc123', 'type': 'function', 'function': {'name': 'search', 'arguments': {'query': 'Q'}}}]", True),
    ("Calling tools:\n[{'id': 'call_abc123', 'type': 'function', 'function': {'name': 'search', 'arguments': {'query': 'edited'}}}]", False),
    ("Calling tools:\n[{'id': 'call_other', 'type': 'function', 'function': {'name': 'search', 'arguments': {'query': 'Q'}}}]", False),
    ("Calling tools:\n[{'id': 'call_abc123', 'function': {'name': 'search'}}]", False),  # not smolagents' shape
    ("Calling tools:\n[__import__('os')]", False),  # never evaluated
])
def test_smolagents_text_echo_is_the_same_turn_only_when_it_means_the_same_call(tokenizer, text, recognised):
    """smolagents flattens the call into text (and sends the result as a user "Observation:")."""
    chat, log, eos = _served_call(tokenizer, '{"query": "Q"}')
    messages = OPENING + [Message("assistant", text), Message("user", "Observation:\nborn in Vexhollow")]
    prompt, seen = chat_prompt(chat, messages, log, {eos})
    log.add(Call(seen, [Completion(prompt, [42, eos], [-0.1, -0.2], Message("assistant", "Vexhollow"), "stop")]), [])
    assert (assemble(log).segment_starts == []) is recognised
