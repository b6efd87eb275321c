"""The agent loop driven by a scripted backend: tool-call handling, limits, and token alignment."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from stages.policy.agent_loop import EpisodeSpec, call_tools, run_episodes
from stages.policy.sampling import Sample, SamplingConfig
from storage.schema import Message, ToolCall
from tasks.base import Prompt, Task

EOS = "<|im_end|>"


def lookup(key: str) -> str:
    return {"a": "apple", "b": "banana"}.get(key, "nothing")


def explode(**_: Any) -> str:
    raise ValueError("boom")


# The hanging tool blocks until the test releases it, after the episodes have ended: if the loop waited
# for it instead of abandoning it at the timeout, `run_episodes` could not return before the release.
HANG_STARTED, HANG_RELEASE, HANG_FINISHED = threading.Event(), threading.Event(), threading.Event()


def hang(**_: Any) -> str:
    HANG_STARTED.set()
    HANG_RELEASE.wait(120)  # bounds a broken loop's wait, so a failure is a failed assert and not a hang
    HANG_FINISHED.set()
    return "too late"


TASK = Task(
    name="toy",
    system_prompt="Answer with the tools.",
    prompts=lambda split: [],
    tools={"lookup": lookup, "explode": explode, "hang": hang},
    tool_specs=[
        {"type": "function", "function": {"name": n, "parameters": {"properties": {}}}}
        for n in ("lookup", "explode", "hang")
    ],
    max_turns=8,
)


def call(name: str, args: str = "{}") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'


# Per episode (keyed by its question): the assistant turns, each with or without a sampled EOS.
SCRIPTS: dict[str, list[tuple[str, bool]]] = {
    "q-tools": [
        (call("lookup", '{"key": "a"}'), True),  # valid
        ('<tool_call>{"name": "lookup", "arguments": {key: a}</tool_call>', True),  # malformed JSON
        (call("search", '{"query": "x"}'), False),  # unknown tool; turn ends without EOS (stop string)
        (call("explode"), True),  # raises
        (call("hang"), True),  # times out
        ("The answer is apple.", True),  # final answer
    ],
    "q-direct": [("42", True)],
    "q-loop": [(call("lookup", '{"key": "b"}'), True)] * 8,
}


class ScriptedBackend:
    """Replays SCRIPTS: finds the episode by its question in the prompt and the turn by counting
    assistant headers; texts are tokenized by the real tokenizer, log-probs are fake but distinct."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = {tokenizer.eos_token_id}
        self.calls: list[int] = []  # batch size of each generate call

    def generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingConfig, seed: int | None = None
    ) -> list[Sample]:
        self.calls.append(len(prompt_token_ids))
        out = []
        for ids in prompt_token_ids:
            prompt = self.tokenizer.decode(ids)
            key = next(k for k in SCRIPTS if k in prompt)
            text, eos = SCRIPTS[key][prompt.count("<|im_start|>assistant") - 1]
            full = self.tokenizer(text + (EOS if eos else ""), add_special_tokens=False)["input_ids"]
            tokens = full[: sampling.max_new_tokens]
            logprobs = [-0.01 * (k + 1) for k in range(len(tokens))]
            text = self.tokenizer.decode(tokens[:-1] if tokens[-1] in self.eos_ids else tokens)
            reason = "stop" if len(tokens) == len(full) else "length"  # no EOS: as if a stop string hit
            out.append(Sample(tokens, logprobs, text, reason))
        return out


def runs(mask: list[int], value: int) -> list[tuple[int, int]]:
    """(start, end) of each maximal run of `value` in `mask`."""
    spans, start = [], None
    for k, m in enumerate(mask + [1 - value]):
        if m == value and start is None:
            start = k
        elif m != value and start is not None:
            spans.append((start, k))
            start = None
    return spans


def specs(*questions: str) -> list[EpisodeSpec]:
    return [EpisodeSpec(Prompt(q, f"question {q}?", {}), seed=n) for n, q in enumerate(questions)]


@pytest.fixture(scope="module")
def episodes(tokenizer: Any) -> Iterator[tuple[list, ScriptedBackend, dict[str, bool]]]:
    backend = ScriptedBackend(tokenizer)
    eps = run_episodes(backend, tokenizer, TASK, specs("q-tools", "q-direct", "q-loop"), SamplingConfig(), 4096, 0.5)
    hung = {
        "started": HANG_STARTED.is_set(),
        "finished": HANG_FINISHED.is_set(),
        "thread_alive": any(t.name == "tool-hang" and t.is_alive() for t in threading.enumerate()),
    }
    yield eps, backend, hung
    HANG_RELEASE.set()  # let the abandoned thread end


def test_a_hung_tool_is_abandoned_at_its_timeout(episodes: tuple) -> None:
    (ep, _, _), _, hung = episodes
    # The episodes ended while the tool was still running: the loop gave up on it, it did not wait.
    assert hung == {"started": True, "finished": False, "thread_alive": True}
    assert [m.content for m in ep.messages if m.role == "tool"][4] == "error: tool 'hang' timed out after 0.5 s"
    assert ep.messages[-1].content == "The answer is apple."  # ...and the episode went on after it


def test_every_tool_failure_becomes_a_message(episodes: tuple) -> None:
    (ep, _, _), _, _ = episodes
    tools = [m for m in ep.messages if m.role == "tool"]
    assert [m.content for m in tools][0] == "apple"
    assert tools[1].content.startswith("error: malformed tool call")
    assert tools[2].content == "error: unknown tool 'search'; available: explode, hang, lookup"
    assert tools[3].content == "error: tool 'explode' raised ValueError: boom"
    assert tools[4].content == "error: tool 'hang' timed out after 0.5 s"
    assert [m.tool_call_id for m in tools] == [f"call_{t}_0" for t in range(5)]
    assert [m.name for m in tools] == ["lookup", "", "search", "explode", "hang"]
    assistant = [m for m in ep.messages if m.role == "assistant"]
    assert [len(m.tool_calls) for m in assistant] == [1, 1, 1, 1, 1, 0]
    assert assistant[0].tool_calls[0] == ToolCall("call_0_0", "lookup", '{"key": "a"}')
    assert (ep.num_turns, ep.num_tool_calls, ep.num_tool_errors) == (6, 5, 4)
    assert (ep.finish_reason, ep.truncated) == ("answer", False)
    assert ep.messages[-1].content == "The answer is apple."


def test_turns_are_batched_and_limits_end_episodes(episodes: tuple) -> None:
    (tools_ep, direct, loop), backend, _ = episodes
    assert backend.calls[:2] == [3, 2]  # all active episodes generate together
    assert (direct.finish_reason, direct.num_turns, direct.num_tool_calls) == ("answer", 1, 0)
    assert (loop.finish_reason, loop.num_turns, loop.num_tool_calls, loop.truncated) == ("max_turns", 8, 7, False)
    assert loop.messages[-1].role == "assistant" and loop.messages[-1].tool_calls  # last call not run
    assert 0 < direct.gen_seconds <= tools_ep.gen_seconds


def test_tokens_masks_and_logprobs_line_up(episodes: tuple, tokenizer: Any) -> None:
    for ep in episodes[0]:
        n = len(ep.token_ids)
        assert len(ep.loss_mask) == len(ep.behavior_logprobs) == n
        # The whole stream is the template's rendering of the stored messages, character for character.
        rendered = tokenizer.apply_chat_template([m.to_openai() for m in ep.messages], tokenize=False)
        assert tokenizer.decode(ep.token_ids) == rendered
        # Each sampled run is one assistant turn: its content, plus EOS when the turn sampled one.
        assistant = [m for m in ep.messages if m.role == "assistant"]
        sampled = runs(ep.loss_mask, 1)
        assert len(sampled) == len(assistant)
        for (a, b), message in zip(sampled, assistant):
            text = tokenizer.decode(ep.token_ids[a:b])
            assert text in (message.content, message.content + EOS)
            assert ep.behavior_logprobs[a:b] == pytest.approx([-0.01 * (k + 1) for k in range(b - a)])
        # Template runs: the opening prompt, then end-of-turn + tool messages + generation prompt.
        template = runs(ep.loss_mask, 0)
        opening = tokenizer.apply_chat_template(
            [m.to_openai() for m in ep.messages[:2]], tokenize=False, add_generation_prompt=True
        )
        assert tokenizer.decode(ep.token_ids[slice(*template[0])]) == opening
        tools = iter(m for m in ep.messages if m.role == "tool")
        for (a, b), (_, prev_end) in zip(template[1:-1], sampled):
            text = tokenizer.decode(ep.token_ids[a:b])
            closing = "\n" if ep.token_ids[prev_end - 1] == tokenizer.eos_token_id else EOS + "\n"
            assert text == f"{closing}<|im_start|>tool\n{next(tools).content}{EOS}\n<|im_start|>assistant\n"
        assert all(ep.behavior_logprobs[k] == 0.0 for k in range(n) if ep.loss_mask[k] == 0)


def test_token_budget_truncates(tokenizer: Any) -> None:
    backend = ScriptedBackend(tokenizer)
    opening = TASK.messages(specs("q-tools")[0].prompt)
    prompt_len = len(tokenizer.apply_chat_template(opening, add_generation_prompt=True, tokenize=True)["input_ids"])
    budget = prompt_len + 50  # room for the first call and its result, not for all of the second call
    (ep,) = run_episodes(backend, tokenizer, TASK, specs("q-tools"), SamplingConfig(), budget, 0.5)
    assert (ep.finish_reason, ep.truncated, ep.num_turns, ep.num_tool_calls) == ("max_tokens", True, 2, 1)
    assert len(ep.token_ids) <= budget
    assert SCRIPTS["q-tools"][1][0].startswith(ep.messages[-1].content)  # the cut second turn
    rendered = tokenizer.apply_chat_template([m.to_openai() for m in ep.messages], tokenize=False)
    assert tokenizer.decode(ep.token_ids) == rendered  # the cut turn is still closed by the template


def test_call_tools_reports_bad_arguments() -> None:
    calls = [
        ToolCall("c0", "lookup", "[1, 2]"),
        ToolCall("c1", "lookup", '{"nope": 1}'),
        ToolCall("c2", "lookup", '{"key": "b"}'),
    ]
    results = call_tools(calls, {"lookup": lookup}, timeout=1.0)
    assert results[0].content == "error: arguments of 'lookup' must be a JSON object" and results[0].error
    assert results[1].content.startswith("error: tool 'lookup' raised TypeError") and results[1].error
    assert (results[2].content, results[2].error) == ("banana", False)


def test_opening_messages_are_stored(episodes: tuple) -> None:
    ep = episodes[0][1]
    assert [m.role for m in ep.messages] == ["system", "user", "assistant"]
    assert ep.messages[0] == Message("system", TASK.messages(specs("q-direct")[0].prompt)[0]["content"])
