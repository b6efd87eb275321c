"""What the RULER judge is asked and how its answer is read: the instructions and rubric, the request (shared
context once, trajectories side by side, a reference when given), the verdict schema that binds a reply, and the
validation of a reply that was not bound. rewards/ruler.py sends the requests, caches and averages.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

DEFAULT_RUBRIC = """\
- A trajectory that achieves its goal should always get a significantly higher score than one that does not.
- A trajectory that achieves its goal more efficiently (fewer unproductive steps, well-formed tool calls) should score higher than one that achieves it less efficiently.
- If one trajectory is only slightly better than another, the difference in scores should be small; if it is much better, the difference should be large.
- Give partial credit to a trajectory that makes real progress towards its goal without completing it."""

INSTRUCTIONS = """\
All of the trajectories below were given the same goal. Consider each of them and give each a score \
between 0 and 1, using your best judgement of the agent's goal (the context and the trajectories show it).

Grading standards:
{rubric}

Reply with only a JSON object, one entry per trajectory, using the trajectory ids as given:
{{"scores": [{{"id": "1", "score": 0.0, "explanation": "one or two sentences"}}, ...]}}"""

REFERENCE = """\

A reference answer for this goal is given in <reference>: a trajectory whose outcome agrees with it achieves \
the goal; one that contradicts it does not."""

EXPLANATION_CHARS = 200  # an explanation's bound in the verdict schema: enough for a reason, not for an essay
# The scores a bound verdict may give: [0, 1] in steps of 0.05. A number type alone would let a constrained judge
# write digits without end (a small model does: 0.0000...); permutations average to finer values.
SCORE_GRID = [round(i / 20, 2) for i in range(21)]

CORRECTION = """\
Your reply could not be used: {reason}
Reply again with only a JSON object of the form {{"scores": [{{"id": ..., "score": ..., "explanation": ...}}]}} \
with exactly one entry for each of the ids {ids} and every score between 0 and 1."""


def common_prefix_len(trajectories: Sequence[list[dict[str, Any]]]) -> int:
    """How many leading messages all trajectories share, leaving each at least its last message to show."""
    n = min(len(t) for t in trajectories) - 1
    for i in range(max(n, 0)):
        if any(t[i] != trajectories[0][i] for t in trajectories):
            return i
    return max(n, 0)


def judge_messages(prefix: list[dict[str, Any]], bodies: Sequence[list[dict[str, Any]]], rubric: str,
                   reference: str | None = None, instructions: str = INSTRUCTIONS) -> list[dict[str, Any]]:
    """The judge request: instructions + rubric, then the reference answer when given, the shared context once and
    the trajectories labelled 1..n."""
    text = ""
    if reference is not None:
        text += f"<reference>\n{reference}\n</reference>\n\n"
    if prefix:
        text += "<context>\n" + json.dumps(prefix, ensure_ascii=False) + "\n</context>\n\n"
    text += "Trajectories:\n\n" + "\n\n".join(
        f'<trajectory id="{i}">\n{json.dumps(body, ensure_ascii=False)}\n</trajectory>' for i, body in enumerate(bodies, 1)
    )
    system = instructions.format(rubric=rubric) + (REFERENCE if reference is not None else "")
    return [{"role": "system", "content": system}, {"role": "user", "content": text}]


def verdict_format(n: int, explanation_chars: int = EXPLANATION_CHARS) -> dict[str, Any]:
    """The `response_format` that binds a reply to this group's verdicts: exactly the ids "1".."n" in order, each
    a score in [0, 1] (on SCORE_GRID) and an optional bounded explanation (OpenAI's, vLLM's, llama.cpp's and `rlops
    serve`'s json_schema). `maxItems` alone bars entries past the n: `"items": false` would say it again, and llama.cpp
    refuses a schema that is not an object."""
    entry = lambda i: {  # noqa: E731
        "type": "object", "additionalProperties": False, "required": ["id", "score"],
        "properties": {"id": {"const": str(i)}, "explanation": {"type": "string", "maxLength": explanation_chars},
                       "score": {"enum": SCORE_GRID}}}
    schema = {"type": "object", "additionalProperties": False, "required": ["scores"],
              "properties": {"scores": {"type": "array", "minItems": n, "maxItems": n,
                                        "prefixItems": [entry(i) for i in range(1, n + 1)]}}}
    return {"type": "json_schema", "json_schema": {"name": "verdicts", "strict": True, "schema": schema}}


def _scores_list(value: Any) -> list[Any] | None:
    """The entries of a decoded reply: its "scores" list, or the value itself when it is a list of
    objects with ids (what a judge writes when it drops the wrapper); None for anything else."""
    if isinstance(value, dict):
        items = value.get("scores")
        return items if isinstance(items, list) else None
    if isinstance(value, list) and value and all(isinstance(v, dict) and "id" in v for v in value):
        return value
    return None


def _embedded_scores(text: str) -> list[Any] | None:
    """The first scores list found as a JSON value inside `text`: a judge without JSON mode (an
    `rlops serve` model, many local servers) often writes prose or code around the object we asked for."""
    decoder = json.JSONDecoder()
    for start in re.finditer(r"[{\[]", text):
        try:
            value, _ = decoder.raw_decode(text, start.start())
        except json.JSONDecodeError:
            continue
        if (items := _scores_list(value)) is not None:
            return items
    return None


def parse_scores(content: str, n: int) -> list[tuple[float, str]]:
    """(score, explanation) for labels 1..n from a judge reply; ValueError saying what is wrong.

    The reply should be the JSON object alone; failing that, the first scores object (or bare list of
    entries) inside it is used. Whatever is found is validated in full."""
    text = re.sub(r"^\s*```(?:json)?\s*|\s*```\s*$", "", content)  # a fenced reply is still the JSON we asked for
    try:
        items = _scores_list(json.loads(text))
    except json.JSONDecodeError as e:
        items = _embedded_scores(text)
        if items is None:
            raise ValueError(f"not valid JSON, and no scores object inside it ({e})") from None
    if items is None:
        raise ValueError('no "scores" list in the reply')
    if len(items) != n:
        raise ValueError(f"expected {n} scores, got {len(items)}")
    found: dict[str, tuple[float, str]] = {}
    for item in items:
        if not isinstance(item, dict) or "id" not in item or "score" not in item:
            raise ValueError(f"each score needs an id and a score, got {str(item)[:100]}")
        key, score = str(item["id"]).strip(), item["score"]
        if key not in {str(i) for i in range(1, n + 1)} or key in found:
            raise ValueError(f"unknown or repeated id {key!r}; the ids are 1..{n}")
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not 0.0 <= score <= 1.0:
            raise ValueError(f"score of id {key} must be a number in [0, 1], got {score!r}")
        found[key] = (float(score), str(item.get("explanation", "")))
    return [found[str(i)] for i in range(1, n + 1)]
