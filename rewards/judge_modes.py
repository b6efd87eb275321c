"""The judge's pointwise and pairwise modes, for judges too small to write a group's verdict: read from the
judge's first-token log-probabilities (one prefill per request, no reply), beside RULER's group ranking
(rewards/ruler.py, `mode: ranking`).

- `yes_no`: per trajectory, "does it achieve its goal?" -> P(true) among true/false (yes/no).
- `scale`: per trajectory, 1-5 -> the expected rating under the judge's distribution, mapped to [0, 1].
- `pairwise`: per pair, "which is better, 1 or 2?" asked in both orders -> P(better) averaged over the orders
  (position bias cancels); a trajectory's score is its mean over the others: n(n-1) requests per group. Its
  details keep each order's probability too (`order_probs`: the label-free promotion gate records both).

A request binds the first token to the choices with a JSON schema (a boolean, an integer enum) where the endpoint
takes one (`rlops serve`: its log-probs are then the bound distribution's); otherwise the choices are read from
the 20 most likely tokens. A judge that puts no probability on any choice fails the group (JudgeError).
Answers are cached like the ranking's (same folder, keyed by model, mode and request).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rewards.judge_client import ChatClient, Completion, JudgeError
from rewards.judge_request import common_prefix_len, judge_messages
from storage.atomic import write_text_atomic
from storage.ids import canonical_json

MODES = ("ranking", "yes_no", "scale", "pairwise")

POINT_RUBRIC = """\
- A trajectory achieves its goal when its final answer or outcome is correct and complete.
- Well-formed tool calls and no unproductive steps count in its favour; a wrong final answer counts against it \
whatever else it did well."""

YES_NO = """\
The trajectory below was given a goal (the context and the trajectory show it). Judge whether it achieves its goal.

Grading standards:
{rubric}

Reply with only `true` if the trajectory achieves its goal, or `false` if it does not."""

SCALE = """\
The trajectory below was given a goal (the context and the trajectory show it). Rate how well it achieves its goal \
on a scale from 1 (not at all) to 5 (completely).

Grading standards:
{rubric}

Reply with only the digit of your rating: 1, 2, 3, 4 or 5."""

PAIR = """\
Both trajectories below were given the same goal (the context and the trajectories show it). Judge which one \
better achieves it.

Grading standards:
{rubric}

Reply with only `1` if trajectory 1 is better, or `2` if trajectory 2 is better."""

# mode -> (instructions, the value of each choice, the JSON schema that binds the first token to the choices)
SPECS: dict[str, tuple[str, dict[str, float], dict[str, Any]]] = {
    "yes_no": (YES_NO, {"true": 1.0, "false": 0.0, "yes": 1.0, "no": 0.0}, {"type": "boolean"}),
    "scale": (SCALE, {str(d): (d - 1) / 4 for d in range(1, 6)}, {"type": "integer", "enum": [1, 2, 3, 4, 5]}),
    "pairwise": (PAIR, {"1": 1.0, "2": 0.0}, {"type": "integer", "enum": [1, 2]}),
}


def choice_format(mode: str) -> dict[str, Any]:
    """The `response_format` binding a `mode` request's first token to its choices."""
    return {"type": "json_schema", "json_schema": {"name": mode, "strict": True, "schema": SPECS[mode][2]}}


def read_choice(top: Sequence[tuple[str, float]], values: dict[str, float], bound: bool) -> tuple[float, dict[str, float]]:
    """(expected value, probability of each choice) under the first-token distribution `top`, restricted to the
    tokens naming a choice (stripped, any case; under a binding schema also a token that begins exactly one choice,
    as "t" begins "true") and renormalised. ValueError when no token names a choice."""
    mass: dict[str, float] = {}
    for token, logprob in top:
        text = token.strip().lower()
        named = [c for c in values if text == c] or ([c for c in values if text and c.startswith(text)] if bound else [])
        if len(named) == 1 and math.isfinite(logprob):
            mass[named[0]] = mass.get(named[0], 0.0) + math.exp(logprob)
    total = sum(mass.values())
    if total <= 0.0:
        seen = ", ".join(repr(t) for t, _ in list(top)[:5])
        raise ValueError(f"none of the judge's likely first tokens ({seen}) is one of {', '.join(values)}")
    probs = {c: m / total for c, m in mass.items()}
    return sum(values[c] * p for c, p in probs.items()), probs


class Asker:
    """One first-token request per call, answered from the cache when it can be; counts what it cost."""

    def __init__(self, client: ChatClient, mode: str, cache_dir: Path | None, schema: bool,
                 on_cost: Callable[[Sequence[Completion], bool], None] | None) -> None:
        self.client, self.mode, self.cache_dir, self.schema, self.on_cost = client, mode, cache_dir, schema, on_cost

    def __call__(self, messages: list[dict[str, Any]]) -> tuple[float, dict[str, float]]:
        _, values, _ = SPECS[self.mode]
        key = hashlib.sha256(canonical_json({"model": self.client.model, "mode": self.mode, "messages": messages,
                                             "schema": self.schema}).encode()).hexdigest()
        path = self.cache_dir / key[:2] / f"{key}.json" if self.cache_dir is not None else None
        try:
            record = json.loads(path.read_text()) if path is not None else None
            top, bound = [(str(t), float(lp)) for t, lp in record["top"]], bool(record["schema_bound"])
            cached = True
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            answer = self.client.first_token(messages, choice_format(self.mode) if self.schema else None,
                                             choices=tuple(values))
            top, bound, cached = list(answer.top), answer.schema_bound, False
            if self.on_cost is not None:
                self.on_cost([answer], False)
        try:
            result = read_choice(top, values, bound)
        except ValueError as e:
            raise JudgeError(f"judge ({self.mode}): {e}") from None
        if path is not None and not cached:
            write_text_atomic(path, json.dumps({"model": self.client.model, "mode": self.mode, "key": key,
                                                "top": top, "schema_bound": bound}, ensure_ascii=False))
        elif cached and self.on_cost is not None:
            self.on_cost([], True)
        return result


def judge_group(trajectories: Sequence[list[dict[str, Any]]], mode: str, client: ChatClient, *,
                rubric: str | None = None, reference: str | None = None, cache_dir: str | Path | None = None,
                schema: bool = True, concurrency: int = 4,
                on_cost: Callable[[Sequence[Completion], bool], None] | None = None) -> list[tuple[float, dict[str, Any]]]:
    """(score in [0, 1], details) per trajectory, in input order, by a pointwise mode (`yes_no`, `scale`: one
    request per trajectory) or `pairwise` (both orders of every pair; details: `win_probs` and `order_probs`, per
    other trajectory, P(this one better) when shown first and when shown second). The shared leading messages are
    shown once as context, as in the ranking. JudgeError when the judge fails or names no choice."""
    if mode not in SPECS:
        raise ValueError(f"judge mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "pairwise" and len(trajectories) < 2:
        raise ValueError("the pairwise mode needs groups of at least 2 trajectories")
    instructions = SPECS[mode][0]
    cut = common_prefix_len(trajectories)
    prefix, bodies = list(trajectories[0][:cut]), [list(t[cut:]) for t in trajectories]
    ask = Asker(client, mode, Path(cache_dir) if cache_dir is not None else None, schema, on_cost)
    shown = [[i] for i in range(len(bodies))] if mode != "pairwise" else \
        [list(pair) for pair in itertools.permutations(range(len(bodies)), 2)]
    requests = [judge_messages(prefix, [bodies[i] for i in order], rubric or POINT_RUBRIC, reference, instructions)
                for order in shown]
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(requests)))) as pool:
        answers = list(pool.map(ask, requests))
    if mode != "pairwise":
        return [(value, {"judge_mode": mode, "choice_probs": probs}) for value, probs in answers]
    # P(i better than j), from i shown first (P("1")) and from j shown first (1 - P("1")), averaged.
    first: dict[tuple[int, int], float] = {(o[0], o[1]): v for o, (v, _) in zip(shown, answers)}
    out = []
    for i in range(len(bodies)):
        others = [j for j in range(len(bodies)) if j != i]
        orders = [(first[(i, j)], 1.0 - first[(j, i)]) for j in others]  # per other: (i shown first, i shown second)
        wins = [(a + b) / 2 for a, b in orders]
        out.append((sum(wins) / len(wins), {"judge_mode": mode, "win_probs": [round(w, 4) for w in wins],
                                            "order_probs": [list(o) for o in orders],
                                            "order_agreement": _agreement(first, i)}))
    return out


def _agreement(first: dict[tuple[int, int], float], i: int) -> float:
    """The share of i's pairs whose two orders pick the same winner (1.0: no position bias showed)."""
    pairs = [(a, b) for a, b in first if a == i]
    same = [(first[(a, b)] > 0.5) == (first[(b, a)] < 0.5) for a, b in pairs]
    return sum(same) / len(same)
