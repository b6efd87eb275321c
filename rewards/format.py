"""Format rewards: a reply that matches a regex, and DeepSeek-R1's layout (`<think>...</think>` then the answer).

    score:
      rewards:
        - {name: think, fn: rewards.format.think_format, weight: 0.2}
        - {name: hashes, fn: rewards.format.matches, params: {pattern: '#### -?[0-9]+\\s*$', mode: search}}
"""

from __future__ import annotations

import re
from typing import Any, Literal

from rewards.base import reward
from rewards.builtin import final_answer
from storage.schema import Rollout

THINK_RE = re.compile(r"\s*<think>(?P<thought>(?:(?!<think>).)*?)</think>(?P<answer>.*)", re.DOTALL)
ANSWER_TAG_RE = re.compile(r"\s*<answer>(?P<answer>.*?)</answer>\s*", re.DOTALL)


@reward(low=0.0, high=1.0)
def matches(rollout: Rollout, pattern: str, mode: Literal["fullmatch", "match", "search"] = "fullmatch",
            flags: str = "s") -> tuple[float, dict[str, Any]]:
    """1.0 if the final reply matches `pattern` (`mode`: the whole reply, its start, or anywhere); `flags` are
    regex flag letters ("s": `.` matches newlines, "i": ignore case, "m": multiline)."""
    compiled = re.compile(pattern, _flags(flags))
    reply = final_answer(rollout)
    found = reply is not None and getattr(compiled, mode)(reply) is not None
    return float(found), {"matched": found}


@reward(low=0.0, high=1.0)
def think_format(rollout: Rollout, answer_tags: bool = False) -> tuple[float, dict[str, Any]]:
    """1.0 for DeepSeek-R1's layout: one `<think>...</think>` block first, then a non-empty answer (with
    `answer_tags`, exactly one `<answer>...</answer>` block after it and nothing else)."""
    reply = final_answer(rollout) or ""
    m = THINK_RE.fullmatch(reply)
    if m is None:
        return 0.0, {"problem": "no <think>...</think> block first" if "<think>" not in reply[:64] else "unclosed or repeated <think>"}
    answer = m["answer"]
    if answer_tags:
        tagged = ANSWER_TAG_RE.fullmatch(answer)
        if tagged is None or not tagged["answer"].strip():
            return 0.0, {"problem": "no single <answer>...</answer> block after </think>"}
    elif not answer.strip() or "<think>" in answer:
        return 0.0, {"problem": "no answer after </think>" if not answer.strip() else "a second <think> block"}
    return 1.0, {"thought_chars": len(m["thought"])}


def _flags(letters: str) -> int:
    table = {"s": re.DOTALL, "i": re.IGNORECASE, "m": re.MULTILINE, "x": re.VERBOSE}
    unknown = set(letters) - set(table)
    if unknown:
        raise ValueError(f"unknown regex flags {''.join(sorted(unknown))!r} (use s, i, m, x)")
    flags = 0
    for letter in letters:
        flags |= table[letter]
    return flags
