"""Table-driven tests of the built-in rewards over hand-built rollouts (through `compute`, as the score stage runs them)."""

from __future__ import annotations

from typing import Any

import pytest

from rewards.base import RewardSpec, compute
from storage.schema import Message, ToolCall


def say(text: str) -> Message:
    return Message("assistant", text)


def call(name: str, arguments: str, call_id: str = "call_0_0") -> Message:
    """An assistant turn making one tool call (content as the model wrote it)."""
    return Message("assistant", f"<tool_call>{arguments}</tool_call>", [ToolCall(call_id, name, arguments)])


def result(text: str, call_id: str = "call_0_0", name: str | None = "search") -> Message:
    return Message("tool", text, tool_call_id=call_id, name=name)


def value(fn: str, messages: list[Message], metadata: dict[str, Any], make_rollout, **params) -> float | None:
    [out] = compute(RewardSpec(fn=f"rewards.builtin.{fn}", params=params), [make_rollout(messages, metadata)])
    return out.value


@pytest.mark.parametrize(
    "messages, answer, expected",
    [
        ([say("82")], 82, 1.0),
        ([say("40 + 42 = 82")], 82, 1.0),  # the last number counts
        ([say("82 is wrong, it is 81")], 82, 0.0),
        ([say("The answer is 82.")], 82, 1.0),  # a trailing period is not a decimal point
        ([say("-7")], -7, 1.0),
        ([say("1,234")], 1234, 1.0),
        ([say("2.50")], 2.5, 1.0),
        ([say("2.5")], "2.5", 1.0),  # ground truth stored as text
        ([say("no idea")], 82, 0.0),
        ([say("9" * 400)], 82, 0.0),  # too long for a float: no number, not an error
        ([], 82, 0.0),  # no assistant turn at all
        ([call("search", '{"query": "82"}')], 82, 0.0),  # ended on a tool call: no answer
        ([say("81"), call("search", '{"query": "x"}')], 81, 0.0),  # a later tool call supersedes the text
    ],
)
def test_numeric_match(messages, answer, expected, make_rollout) -> None:
    assert value("numeric_match", messages, {"answer": answer}, make_rollout) == expected


def test_numeric_match_without_ground_truth_is_an_error(make_rollout) -> None:
    [out] = compute(RewardSpec(fn="rewards.builtin.numeric_match"), [make_rollout([say("82")], {})])
    assert out.value is None and out.error == "KeyError: 'answer'"


@pytest.mark.parametrize(
    "messages, answer, expected",
    [
        ([say("3")], 3, 1.0),
        ([say("3: two circles and a square")], 3, 1.0),  # the first integer counts, not the last
        ([say("There are 2 circles and 1 square, so 3")], 3, 0.0),
        ([say("13")], 3, 0.0),  # a whole integer, not a digit of one
        ([say("three")], 3, 0.0),  # digits only
        ([say("4")], "4", 1.0),  # ground truth stored as text
        ([], 3, 0.0),  # no assistant turn at all
        ([call("zoom", '{"x": 3}')], 3, 0.0),  # ended on a tool call: no answer
    ],
)
def test_first_integer_match(messages, answer, expected, make_rollout) -> None:
    assert value("first_integer_match", messages, {"answer": answer}, make_rollout) == expected


@pytest.mark.parametrize(
    "text, answer, mode, expected",
    [
        ("Paris", "Paris", "exact", 1.0),
        ("  Paris\n", "Paris", "exact", 1.0),
        ("paris", "Paris", "exact", 0.0),
        ("paris!", "Paris", "normalized", 1.0),
        ("The  EIFFEL-tower.", "the eiffel tower", "normalized", 1.0),
        ("Paris, France", "Paris", "normalized", 0.0),
        ("It is Paris, France.", "paris", "contains", 1.0),
        ("Parisian food", "paris", "contains", 0.0),  # whole words only
        ("d123", "d12", "contains", 0.0),
        ("anything", "", "contains", 0.0),  # an empty ground truth matches nothing
    ],
)
def test_exact_match(text, answer, mode, expected, make_rollout) -> None:
    assert value("exact_match", [say(text)], {"answer": answer}, make_rollout, mode=mode) == expected


def test_exact_match_rejects_unknown_mode(make_rollout) -> None:
    [out] = compute(RewardSpec(fn="rewards.builtin.exact_match", params={"mode": "fuzzy"}), [make_rollout([say("x")], {"answer": "x"})])
    assert out.value is None and "mode must be" in out.error


TOOLS = ["search", "read"]


@pytest.mark.parametrize(
    "messages, params, expected",
    [
        ([say("82")], {"tools": TOOLS}, 1.0),
        ([call("search", '{"query": "capital"}'), result("d1: ..."), say("Paris")], {"tools": TOOLS}, 1.0),
        ([call("search", '{"query": "capital"'), say("Paris")], {"tools": TOOLS}, 0.0),  # malformed arguments
        ([call("search", '["capital"]'), say("Paris")], {"tools": TOOLS}, 0.0),  # arguments not an object
        ([call("browse", '{"url": "x"}'), say("Paris")], {"tools": TOOLS}, 0.0),  # unknown tool
        ([call("browse", '{"url": "x"}'), say("Paris")], {}, 1.0),  # no tool list: any named tool
        ([call("", '{"name": broken')], {}, 0.0),  # unparseable call: no name
        ([call("search", '{"query": "x"}')], {"tools": TOOLS}, 0.0),  # no final answer
        ([call("search", '{"query": "x"}')], {"tools": TOOLS, "require_answer": False}, 1.0),
        ([say("   ")], {}, 0.0),  # a blank answer is no answer
    ],
)
def test_format_ok(messages, params, expected, make_rollout) -> None:
    assert value("format_ok", messages, {}, make_rollout, **params) == expected


@pytest.mark.parametrize(
    "loss_mask, limit, expected",
    [
        ([], 100, 0.0),
        ([1] * 50, 100, -0.5),
        ([1] * 50 + [0] * 500, 100, -0.5),  # prompt and tool-result tokens do not count
        ([1] * 100, 100, -1.0),
        ([1] * 1000, 100, -1.0),  # bounded
    ],
)
def test_length_penalty(loss_mask, limit, expected, make_rollout) -> None:
    [out] = compute(RewardSpec(fn="rewards.builtin.length_penalty", params={"limit": limit}), [make_rollout([say("x")], loss_mask=loss_mask)])
    assert out.value == expected


@pytest.mark.parametrize(("generated", "expected"), [(10, 0.0), (12, 0.0), (14, -0.5), (16, -1.0), (20, -1.0)])
def test_the_soft_overlong_penalty_ramps_over_the_buffer(generated, expected, make_rollout) -> None:
    # DAPO's soft overlong punishment, max 16 tokens, buffer 4: free up to 12, then (12 - n) / 4, -1 at the budget
    spec = RewardSpec(fn="rewards.builtin.overlong_penalty", params={"max_tokens": 16, "buffer": 4})
    [out] = compute(spec, [make_rollout([say("x")], loss_mask=[0] * 7 + [1] * generated)])
    assert out.value == pytest.approx(expected) and out.details["generated_tokens"] == generated
    [bad] = compute(RewardSpec(fn="rewards.builtin.overlong_penalty", params={"max_tokens": 16, "buffer": 0}),
                    [make_rollout([say("x")])])
    assert bad.value is None and "buffer" in bad.error


READ_D12 = call("read", '{"doc_id": "d12"}', "call_1_0")


@pytest.mark.parametrize(
    "messages, params, expected",
    [
        ([READ_D12, result("text of d12", "call_1_0", "read"), say("x")], {}, 1.0),
        ([call("search", '{"query": "q"}'), result("d3: foo\nd12: bar"), say("x")], {}, 1.0),
        ([call("search", '{"query": "q"}'), result("d3: foo\nd12: bar")], {"search_credit": 0.5}, 0.5),
        ([call("search", '{"query": "q"}'), result("d3: foo\nd12: bar", name=None)], {}, 1.0),  # matched by call id
        ([call("search", '{"query": "q"}'), result("d123: foo, xd12")], {}, 0.0),  # whole ids only
        ([call("search", '{"query": "d12"}'), result("No documents match 'd12'.")], {}, 0.0),  # an echo is no hit
        ([call("read", '{"doc_id": " d12 "}', "call_1_0"), say("x")], {}, 1.0),  # the tool strips the id too
        ([call("search", '{"query": "d12"}'), result("nothing found")], {}, 0.0),  # the query is not a result
        ([call("read", '{"doc_id": "d3"}'), result("d12 is mentioned", name="read")], {}, 0.0),  # read text is not search
        ([call("read", '{"doc_id": "d12"')], {}, 0.0),  # malformed read
        ([say("d12")], {}, 0.0),
    ],
)
def test_doc_retrieved(messages, params, expected, make_rollout) -> None:
    assert value("doc_retrieved", messages, {"answer": "x", "answer_doc_id": "d12"}, make_rollout, **params) == expected


def test_doc_retrieved_on_doc_search_output(make_rollout) -> None:
    # The exact shape tasks/doc_search.py's search tool writes.
    hits = "doc-007: Sabeist 500 — The Sabeist 500 is a desk lamp.\ndoc-0012: Other — More."
    messages = [call("search", '{"query": "lamp"}'), result(hits), say("1958")]
    assert value("doc_retrieved", messages, {"answer_doc_id": "doc-007"}, make_rollout) == 1.0
    assert value("doc_retrieved", messages, {"answer_doc_id": "doc-001"}, make_rollout) == 0.0
