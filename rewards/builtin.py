"""Built-in rewards: answer matching, format checks, a length penalty, and doc_search tool-use shaping.

Each is a plain decorated function over one `Rollout`; ground truth comes from `rollout.metadata`.
Their versions follow the rule for every reward (`rewards.reach`): editing a helper or constant a
reward reaches (`final_answer`, `NUMBER_RE`, ...) changes the version of every reward that calls it.

The final answer is the content of the last assistant message when that message makes no tool
call; an episode that ended on a tool call (turn limit) has no answer.
"""

from __future__ import annotations

import json
import math
import re
import string
from typing import Any

from rewards.declare import reward
from storage.schema import Message, Rollout

# Integers, decimals, thousands separators and signs: "-1,234.5" -> -1234.5.
NUMBER_RE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
INTEGER_RE = re.compile(r"-?\d+")
_PUNCT = str.maketrans({c: " " for c in string.punctuation})


def final_answer(rollout: Rollout) -> str | None:
    """The final answer text, or None if the episode did not end on an assistant message without tool calls."""
    last = next((m for m in reversed(rollout.messages) if m.role == "assistant"), None)
    if last is None or last.tool_calls:
        return None
    return last.content or ""


def last_number(text: str) -> float | None:
    """The last number written in `text` (commas as thousands separators), or None (also for one too long for a float)."""
    found = NUMBER_RE.findall(text)
    value = float(found[-1].replace(",", "")) if found else None
    return value if value is not None and math.isfinite(value) else None


def normalize(text: str) -> str:
    """Lowercase, punctuation to spaces, whitespace collapsed: 'The  Eiffel-Tower!' -> 'the eiffel tower'."""
    return " ".join(text.lower().translate(_PUNCT).split())


def tool_calls(rollout: Rollout) -> list[tuple[Message, int]]:
    """Every (assistant message, index of its tool call) pair, in order."""
    return [(m, i) for m in rollout.messages if m.role == "assistant" for i in range(len(m.tool_calls))]


def json_args(arguments: str) -> dict[str, Any] | None:
    """Tool-call arguments parsed as a JSON object, or None if they are not one."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


@reward(low=0.0, high=1.0)
def numeric_match(rollout: Rollout, key: str = "answer", tolerance: float = 1e-6) -> tuple[float, dict[str, Any]]:
    """1.0 if the last number in the final answer equals `metadata[key]` (within `tolerance`), else 0.0."""
    expected = float(rollout.metadata[key])  # a missing ground truth is an error row, not a silent 0
    answer = final_answer(rollout)
    predicted = last_number(answer) if answer is not None else None
    ok = predicted is not None and abs(predicted - expected) <= tolerance
    return float(ok), {"predicted": predicted, "expected": expected}


@reward(low=0.0, high=1.0)
def first_integer_match(rollout: Rollout, key: str = "answer") -> tuple[float, dict[str, Any]]:
    """1.0 if the first integer in the final answer equals `metadata[key]`, else 0.0. The first, not the
    last: a count answered as "3: two circles and a square" is 3 (tasks/count_shapes.py)."""
    expected = int(rollout.metadata[key])  # a missing ground truth is an error row, not a silent 0
    answer = final_answer(rollout)
    found = INTEGER_RE.search(answer) if answer is not None else None
    predicted = int(found.group()) if found else None
    return float(predicted == expected), {"predicted": predicted, "expected": expected}


@reward(low=0.0, high=1.0)
def exact_match(rollout: Rollout, key: str = "answer", mode: str = "normalized") -> tuple[float, dict[str, Any]]:
    """1.0 if the final answer matches `metadata[key]`, else 0.0.

    mode: `exact` (after stripping outer whitespace), `normalized` (case, punctuation and spacing
    ignored), or `contains` (the normalized expected answer appears as whole words in the answer).
    """
    if mode not in ("exact", "normalized", "contains"):
        raise ValueError(f"mode must be exact, normalized or contains, got {mode!r}")
    expected = str(rollout.metadata[key])
    answer = final_answer(rollout)
    if answer is None:
        ok = False
    elif mode == "exact":
        ok = answer.strip() == expected.strip()
    elif mode == "normalized":
        ok = normalize(answer) == normalize(expected)
    else:
        # Padding with spaces makes the containment whole-word: "12" is not found in "123".
        ok = bool(normalize(expected)) and f" {normalize(expected)} " in f" {normalize(answer)} "
    return float(ok), {"answer": answer, "expected": expected, "mode": mode}


@reward(low=0.0, high=1.0)
def format_ok(
    rollout: Rollout, tools: list[str] | None = None, require_answer: bool = True
) -> tuple[float, dict[str, Any]]:
    """1.0 if every tool call has a known name and JSON-object arguments, and (if required) an answer is present.

    tools: the known tool names; None accepts any non-empty name (set it: the rollout does not say
    which tools its task had).
    """
    problems = []
    for message, i in tool_calls(rollout):
        call = message.tool_calls[i]
        if not call.name or (tools is not None and call.name not in tools):
            problems.append(f"{call.id}: unknown tool {call.name!r}")
        elif json_args(call.arguments) is None:
            problems.append(f"{call.id}: arguments are not a JSON object")
    has_answer = bool((final_answer(rollout) or "").strip())
    if require_answer and not has_answer:
        problems.append("no final answer")
    return float(not problems), {"problems": problems, "has_answer": has_answer}


@reward(low=-1.0, high=0.0, tokens=True)
def length_penalty(rollout: Rollout, limit: int = 512) -> tuple[float, dict[str, Any]]:
    """-min(1, n / limit), n = tokens the policy generated (loss_mask == 1). Scale it with the spec's weight."""
    if limit <= 0:
        raise ValueError(f"limit must be positive, got {limit}")
    generated = sum(rollout.loss_mask)  # tool results and prompts are not the policy's verbosity
    return -min(1.0, generated / limit), {"generated_tokens": generated, "limit": limit}


@reward(low=-1.0, high=0.0, tokens=True)
def overlong_penalty(rollout: Rollout, max_tokens: int, buffer: int) -> tuple[float, dict[str, Any]]:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13): 0 up to `max_tokens - buffer` generated tokens,
    then falling linearly to -1 at `max_tokens` (and -1 beyond), n = tokens the policy generated (loss_mask == 1).
    Set `max_tokens` to the rollout's budget (`rollout.max_new_tokens`), add it to the task reward with weight 1."""
    if not 0 < buffer <= max_tokens:
        raise ValueError(f"need 0 < buffer <= max_tokens, got buffer={buffer}, max_tokens={max_tokens}")
    generated = sum(rollout.loss_mask)
    value = max(-1.0, min(0.0, (max_tokens - buffer - generated) / buffer))
    return value, {"generated_tokens": generated, "max_tokens": max_tokens, "buffer": buffer}


@reward(low=0.0, high=1.0)
def doc_retrieved(
    rollout: Rollout, key: str = "answer_doc_id", search_credit: float = 1.0
) -> tuple[float, dict[str, Any]]:
    """doc_search shaping: 1.0 if the agent `read` the answer document, `search_credit` if it only
    appeared as a hit of a `search` (a result line starting with its id), else 0.0."""
    doc_id = str(rollout.metadata[key])
    names = {m.tool_calls[i].id: m.tool_calls[i].name for m, i in tool_calls(rollout)}
    was_read = any(
        m.tool_calls[i].name == "read"
        and str((json_args(m.tool_calls[i].arguments) or {}).get("doc_id", "")).strip() == doc_id  # `read` strips too
        for m, i in tool_calls(rollout)
    )
    # A search result lists one hit per line as "doc_id: title — ...": the id must start a line, so an id
    # echoed inside a message ("No documents match 'doc-001'") or a longer id ("doc-0012") does not count.
    hit_re = re.compile(rf"^\s*{re.escape(doc_id)}(?![\w-])", re.MULTILINE)
    in_search = any(
        m.role == "tool" and (m.name or names.get(m.tool_call_id or "")) == "search" and hit_re.search(m.content or "")
        for m in rollout.messages
    )
    value = 1.0 if was_read else search_credit if in_search else 0.0
    return value, {"read": was_read, "in_search": in_search, "doc_id": doc_id}


@reward(low=-1e6, high=1e6)
def env(rollout: Rollout) -> tuple[float, dict[str, Any]]:
    """An environment episode's own reward (tasks/environment.py): the sum of its step rewards, or the
    last one, as the task's `reward` param said (stored in metadata.env.config.reward). A step without
    a reward (an unparsed action) counts 0; an episode with no step scores 0."""
    mode = rollout.metadata["env"]["config"]["reward"]  # not an environment episode: an error row, not a 0
    steps = rollout.metadata.get("env_steps") or []
    rewards = [s["reward"] or 0.0 for s in steps]
    value = sum(rewards) if mode == "sum" else (rewards[-1] if rewards else 0.0)
    return float(value), {"mode": mode, "steps": len(steps), "end": rollout.metadata.get("env_end"),
                          "env": {k: rollout.metadata["env"].get(k) for k in ("source", "server")}}
