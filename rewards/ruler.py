"""RULER-style judge: an LLM scores a whole group of trajectories against each other (after OpenPipe ART's RULER).

Two layers:
- `rank(trajectories, rubric, client)`: one judge request per group (per permutation). The
  messages all trajectories share are sent once as context, then the rest of each trajectory,
  side by side, labelled "1".."n" in the order shown. The judge answers
  `{"scores": [{"id": "1", "score": 0.0-1.0, "explanation": "..."}]}`, which is validated
  (count, ids, range); an invalid answer gets one retry with a correction, then JudgeError.
  `permutations=k` judges k orders (rotations of a seeded shuffle, so with k = n every trajectory
  is shown once in every position) and averages per trajectory, to cancel position bias.
  Validated answers are cached as JSON files keyed by sha256(model, rubric, request, order).
- `ruler_reward`: a group reward for a `RewardSpec`, keeping explanations in details; `mode` picks the ranking
  or one of the pointwise/pairwise modes read from log-probs (rewards/judge_modes.py).

What the judge is asked, the verdict schema and the validation of a reply live in rewards/judge_request.py.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rewards.base import NOT_APPLICABLE, describe_error, group_reward
from rewards.judge_client import ChatClient, Completion, JudgeError, OpenAIClient, TransformersClient, scrub
from rewards.judge_modes import MODES, judge_group
from rewards.judge_request import (CORRECTION, DEFAULT_RUBRIC, REFERENCE, common_prefix_len,  # noqa: F401 - re-exported
                                   judge_messages, parse_scores, verdict_format)
from rewards.reach_origin import local_path, path_content_hash
from storage.atomic import write_text_atomic
from storage.ids import canonical_json
from storage.schema import Rollout


@dataclass(frozen=True)
class JudgeScore:
    """The judge's verdict on one trajectory: mean score over permutations, and what it said."""

    id: str
    score: float
    explanation: str
    scores: tuple[float, ...] = ()  # one per permutation, in permutation order
    schema_bound: bool = False  # every verdict behind it was bound to the verdict schema (else: validated only)


@dataclass
class Usage:
    """What judging cost: requests sent, tokens, and permutations answered from the cache."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cache_hits: int = 0

    def add(self, completions: Sequence[Completion], cached: bool) -> None:
        self.requests += len(completions)
        self.prompt_tokens += sum(c.prompt_tokens for c in completions)
        self.completion_tokens += sum(c.completion_tokens for c in completions)
        self.cache_hits += int(cached)


def orders(n: int, k: int, seed: str) -> list[list[int]]:
    """k presentation orders of n trajectories: evenly spaced rotations of one seeded shuffle."""
    base = list(range(n))
    random.Random(seed).shuffle(base)  # a str seed is hashed with sha512: the same in every process
    return [base[(j * n) // k :] + base[: (j * n) // k] for j in range(k)]


def _cache_file(cache_dir: Path, key: str) -> Path:
    return cache_dir / key[:2] / f"{key}.json"


def _cache_read(path: Path) -> tuple[list[tuple[float, str]], bool] | None:
    try:
        record = json.loads(path.read_text())
        return [(float(s), str(e)) for s, e in record["scores"]], bool(record.get("schema_bound", False))
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None  # a missing (or hand-damaged) entry is a miss: ask the judge again


def _cache_write(path: Path, record: dict[str, Any]) -> None:
    # A reader (or a crash) never sees half a file; temp names never end in .json.
    write_text_atomic(path, json.dumps(record, ensure_ascii=False))


def _judge(
    client: ChatClient, messages: list[dict[str, Any]], n: int, key: str, cache_dir: Path | None, schema: bool = True
) -> tuple[list[tuple[float, str]], list[Completion], bool, bool]:
    """Scores for one presentation (from the cache, or the judge with one correction retry), the completions
    asked for, whether it was a cache hit, and whether the verdict was bound to the schema."""
    if cache_dir is not None and (hit := _cache_read(_cache_file(cache_dir, key))) is not None:
        return hit[0], [], True, hit[1]
    fmt = verdict_format(n) if schema else None
    first = client.complete(messages, response_format=fmt)
    try:
        scores, completions = parse_scores(first.content, n), [first]
    except ValueError as e:
        retry = messages + [
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": CORRECTION.format(reason=e, ids=", ".join(str(i) for i in range(1, n + 1)))},
        ]
        second = client.complete(retry, response_format=fmt)
        try:
            scores, completions = parse_scores(second.content, n), [first, second]
        except ValueError as e2:
            raise JudgeError(f"judge output invalid after one retry: {e2}") from None
    bound = completions[-1].schema_bound
    if cache_dir is not None:
        reply = completions[-1].content  # kept for audits: what the judge actually said
        _cache_write(_cache_file(cache_dir, key), {"model": client.model, "key": key, "scores": scores, "reply": reply,
                                                   "schema_bound": bound})
    return scores, completions, False, bound


def rank(
    trajectories: Sequence[list[dict[str, Any]]],
    rubric: str | None,
    client: ChatClient,
    *,
    ids: Sequence[str] | None = None,
    permutations: int = 1,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    usage: Usage | None = None,
    schema: bool = True,
    reference: str | None = None,
) -> list[JudgeScore]:
    """Score a group of trajectories (OpenAI-style message lists) relative to each other.

    Returns one JudgeScore per trajectory, in input order, with `ids[i]` (default "1".."n") as id.
    `schema`: bind the reply to `verdict_format` (where the server takes it; validated either way).
    `reference`: a reference answer the judge sees (reference-guided grading).
    Raises JudgeError if the judge fails or answers invalidly twice for any permutation.
    `usage`, if given, is increased by what this call cost.
    """
    if not trajectories:
        return []
    if permutations < 1:
        raise ValueError(f"permutations must be >= 1, got {permutations}")
    rubric = rubric or DEFAULT_RUBRIC
    n = len(trajectories)
    cut = common_prefix_len(trajectories)
    prefix, bodies = list(trajectories[0][:cut]), [list(t[cut:]) for t in trajectories]
    group_key = hashlib.sha256(canonical_json([prefix, bodies]).encode()).hexdigest()
    cache = Path(cache_dir) if cache_dir is not None else None

    def one(order: list[int]) -> tuple[list[tuple[float, str]], list[Completion], bool, bool]:
        messages = judge_messages(prefix, [bodies[i] for i in order], rubric, reference)
        key_fields = {"model": client.model, "rubric": rubric, "messages": messages, "order": order}
        key = hashlib.sha256(canonical_json(key_fields).encode()).hexdigest()
        return _judge(client, messages, n, key, cache, schema)

    plan = orders(n, permutations, f"{seed}:{group_key}")
    if permutations > 1:
        with ThreadPoolExecutor(max_workers=permutations) as pool:  # the client's semaphore caps requests in flight
            results = list(pool.map(one, plan))
    else:
        results = [one(plan[0])]

    per_traj: list[list[tuple[float, str]]] = [[] for _ in range(n)]
    bound = all(r[3] for r in results)
    for order, (scores, completions, cached, _) in zip(plan, results):
        if usage is not None:
            usage.add(completions, cached)
        for position, traj in enumerate(order):
            per_traj[traj].append(scores[position])
    labels = list(ids) if ids is not None else [str(i) for i in range(1, n + 1)]
    return [
        JudgeScore(
            id=labels[i],
            score=sum(s for s, _ in got) / len(got),
            explanation=" | ".join(e for _, e in got),
            scores=tuple(s for s, _ in got),
            schema_bound=bound,
        )
        for i, got in enumerate(per_traj)
    ]


_clients_lock = threading.Lock()


@dataclass(frozen=True)
class JudgeConfig:
    """Which judge and how to reach it. Frozen and hashable: one client is shared per config."""

    model: str  # the served model name (openai) or a local folder / hub id (transformers)
    backend: str = "openai"  # openai: any OpenAI-compatible server at base_url; transformers: a local model
    base_url: str | None = None  # e.g. http://localhost:8000/v1
    api_key_env: str | None = None  # the env var holding the API key (never the key itself)
    timeout: float = 60.0  # seconds per request
    max_retries: int = 3  # transient failures (429, 5xx, connection errors) retried with backoff
    concurrency: int = 4  # requests in flight across all groups being scored
    backoff: float = 1.0  # first retry delay in seconds, doubled each time
    max_tokens: int | None = None  # the judge's reply limit (None: the server's default; 1024 locally)


def make_client(config: JudgeConfig) -> ChatClient:
    """One shared client per judge config, so its semaphore caps requests across all groups being scored
    and a local model is loaded once (the lock stops threads scoring their first groups from each building one)."""
    with _clients_lock:
        return _make_client(config)


@functools.lru_cache(maxsize=16)
def _make_client(config: JudgeConfig) -> ChatClient:
    if config.backend == "openai":
        if not config.base_url:
            raise ValueError("the openai judge backend needs base_url (e.g. http://localhost:8000/v1)")
        return OpenAIClient(config.base_url, config.model, api_key_env=config.api_key_env, timeout=config.timeout,
                            max_retries=config.max_retries, concurrency=config.concurrency, backoff=config.backoff,
                            max_tokens=config.max_tokens)
    if config.backend == "transformers":
        return TransformersClient(config.model, max_new_tokens=config.max_tokens or 1024)
    raise ValueError(f"judge backend must be openai or transformers, got {config.backend!r}")


def _params_check(task_name: str, task_params: dict[str, Any], params: dict[str, Any]) -> list[str]:
    """What a config check can say of the judge's params before any rollout: the mode, the permutations."""
    problems = []
    if params.get("mode", "ranking") not in MODES:
        problems.append(f"mode must be one of {', '.join(MODES)}, got {params['mode']!r}")
    if params.get("mode", "ranking") != "ranking" and params.get("permutations", 1) != 1:
        problems.append("permutations is the ranking mode's (pairwise asks both orders of every pair itself)")
    return problems


@group_reward(
    low=0.0,
    high=1.0,
    unversioned=("timeout", "max_retries", "concurrency", "backoff", "cache_dir"),
    content=("model", "weights"),
    task_check=_params_check,
)
def ruler_reward(
    group: list[Rollout],
    model: str,
    base_url: str | None = None,
    api_key_env: str | None = None,
    rubric: str | None = None,
    permutations: int = 1,
    seed: int = 0,
    backend: str = "openai",
    max_tokens: int | None = None,
    timeout: float = 60.0,
    max_retries: int = 3,
    concurrency: int = 4,
    backoff: float = 1.0,
    cache_dir: str | None = None,
    schema: bool = True,
    reference: bool | str = False,
    mode: str = "ranking",
    weights: str | None = None,
) -> list[tuple[float, dict[str, Any]]]:
    """RULER score of each rollout of one group, with the judge's explanation in details.

    schema: bind the judge's reply to the group's verdict schema (`verdict_format`: the ids, scores in [0, 1],
    bounded explanations) where the endpoint takes `response_format: json_schema`; an endpoint that refuses it is
    asked without, and its reply validated (details.verdict_format says which). reference: show the judge the
    prompt's ground truth, `metadata["answer"]` (True) or `metadata[reference]` (a key): reference-guided grading.
    mode: `ranking` (one verdict per group, RULER's), or read from the judge's first-token log-probs: `yes_no`,
    `scale` (1-5) per trajectory, `pairwise` (both orders of every pair); `permutations` is the ranking's alone.
    weights: the judge's weights (a local folder or file, e.g. what `rlops model prepare` made for the model an
    endpoint serves): their content enters the reward's version, as a local `model`'s does.

    backend: `openai` (any OpenAI-compatible server at `base_url`) or `transformers` (`model` is a local
    folder or hub id). max_tokens: the judge's reply limit (None: the server's default; 1024 locally).
    The API key is read from the env var named `api_key_env` and is scrubbed from any error text.
    timeout/max_retries/concurrency/backoff/cache_dir do not change values, so they are not versioned.
    """
    try:
        client = make_client(JudgeConfig(model, backend=backend, base_url=base_url, api_key_env=api_key_env, timeout=timeout,
                                         max_retries=max_retries, concurrency=concurrency, backoff=backoff,
                                         max_tokens=max_tokens))
        usage = Usage()
        key = ("answer" if reference is True else reference) or None
        if key is not None and key not in group[0].metadata:
            raise KeyError(f"reference: the rollouts' metadata has no {key!r} (it has: {', '.join(group[0].metadata)})")
        shown = None if key is None else str(group[0].metadata[key])
        if cache_dir is not None and weights is not None and (path := local_path(weights)) is not None:
            # verdicts of other weights served under the same name are not these weights' verdicts
            cache_dir = str(Path(cache_dir) / f"weights-{path_content_hash(path)[:16]}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "pairwise" and len(group) < 2:  # an evaluation's group of one (`samples: 1`): nothing to compare
            return [(NOT_APPLICABLE, {"judge_mode": mode, "reason": "a group of one has no pair to compare"})]
        if mode != "ranking":
            scored = judge_group([[m.to_openai() for m in r.messages] for r in group], mode, client, rubric=rubric,
                                 reference=shown, cache_dir=cache_dir, schema=schema, concurrency=concurrency,
                                 on_cost=usage.add)
            extra = {"judge_model": model, "group_usage": asdict(usage), **({"reference": key} if key else {})}
            return [(value, {**details, **extra}) for value, details in scored]
        ranked = rank(
            [[m.to_openai() for m in r.messages] for r in group],
            rubric,
            client,
            ids=[r.rollout_id for r in group],
            permutations=permutations,
            seed=seed,
            cache_dir=cache_dir,
            usage=usage,
            schema=schema,
            reference=shown,
        )
    except Exception as e:
        # Whatever failed, its text is recorded in every row of the group: make sure the key is not in it.
        text = str(e) if isinstance(e, JudgeError) else describe_error(e)
        raise JudgeError(scrub(text, [os.environ.get(api_key_env or "", "")])) from None
    group_usage = asdict(usage)  # the whole group's cost, repeated on each of its rows
    return [
        (s.score, {"explanation": s.explanation, "permutation_scores": list(s.scores), "judge_model": model,
                   "group_usage": group_usage, "verdict_format": "json_schema" if s.schema_bound else "validated",
                   **({"reference": key} if key is not None else {})})
        for s in ranked
    ]
