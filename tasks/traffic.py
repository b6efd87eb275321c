"""Served traffic as a task: the conversations `rlops serve` answered become the prompts the policy re-samples.

    task:
      name: traffic
      params:
        since: "2026-12-06T03:00:00+00:00"     # a window over `traffic.served_at` (the nightly loop sets both)
        until: "2026-12-07T03:00:00+00:00"
        where: "user_id IS NOT NULL AND tags->>'app' = 'web'"   # any SQL condition over the `traffic` view
        test_fraction: 0.2                      # the share of sessions held out (the gate's scenarios)

A scenario is a served conversation up to a served assistant turn: one call's conversation as the model saw it
(`traffic.messages`), which the built-in loop continues with a group of fresh samples (`max_turns` turns; the
tools a client ran are not here, so one turn by default). With an agent named (`entry` or `url`, as `task: agent`
takes them), a scenario is instead an episode's first user message, and the agent runs again on it with its own
tools, through the policy service.

Scenarios are deduplicated by content (`traffic.scenario_id`, or `input_id` for an agent: case and whitespace
normalised, storage/traffic.py), the earliest call standing for its copies. Train and held-out are split by a stable
hash of the session (`seed`), so a conversation's calls land on one side; a scenario asked in a held-out session is
held out even if another session asked it too, so nothing held out is trained on. `max_scenarios` keeps that many of
each split, chosen by the same hash. The set is the task's data version: the same window reruns as the same artifacts,
new traffic is new data. A scenario's prompt id is its content key, so SQL joins a person's calls to the rollouts
re-sampled from them (`traffic.scenario_id = rollouts.prompt_id`).

The traffic is read from the workspace's SQL views, read-only. `workspace` is filled in with the run's when the config
is loaded (`in_workspace`), and `rlops run` and the nightly loop close an open window at their start (`closed`), so
every process of a run reads the same scenarios (docs/LOOP.md).
"""

from __future__ import annotations

import functools
import hashlib
from datetime import datetime, timezone
from typing import Any

from storage.ids import canonical_json
from tasks.base import Prompt, Task, TaskParamsError

COLUMNS = "call_id, served_at, session_id, messages, scenario_id, input_id"


def make_task(workspace: str | None = None, since: str | None = None, until: str | None = None, where: str | None = None,
              test_fraction: float = 0.2, seed: int = 0, max_scenarios: int | None = None, max_turns: int = 1,
              entry: str | None = None, url: str | None = None, version: str | None = None,
              max_error_frac: float = 0.25, episode_timeout: float = 600.0) -> Task:
    """The scenarios of the traffic in the window [since, until) that match `where` (module docstring)."""
    problems = []
    if not 0.0 <= test_fraction < 1.0:
        problems.append(f"task.params.test_fraction: must be in [0, 1), got {test_fraction}")
    if max_scenarios is not None and max_scenarios < 1:
        problems.append(f"task.params.max_scenarios: must be >= 1, got {max_scenarios}")
    window = [_instant(name, value, problems) for name, value in (("since", since), ("until", until))]
    if problems:
        raise TaskParamsError(problems)
    agent = entry is not None or url is not None
    splits = scenarios(workspace, window[0], window[1], where, test_fraction, seed, max_scenarios, agent)
    data = canonical_json({s: [[p.prompt_id, p.question, list(p.messages or ())] for p in ps] for s, ps in splits.items()})
    spec = None
    if agent:
        from tasks.agent import agent_spec

        spec = agent_spec(entry, url, version, data.encode(), max_error_frac, episode_timeout)
    return Task(name="traffic", system_prompt="", prompts=lambda split: list(splits.get(split, [])), max_turns=max_turns,
                agent=spec, data_version=hashlib.sha256(data.encode()).hexdigest()[:16], live=True)


def _instant(name: str, value: str | None, problems: list[str]) -> datetime | None:
    if value is None:
        return None
    try:
        t = datetime.fromisoformat(value)
    except (TypeError, ValueError):
        problems.append(f"task.params.{name}: an ISO 8601 time (2026-12-07T03:00:00+00:00), got {value!r}")
        return None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


@functools.lru_cache(maxsize=16)
def scenarios(workspace: str | None, since: datetime | None, until: datetime | None, where: str | None,
              test_fraction: float, seed: int, max_scenarios: int | None, agent: bool) -> dict[str, list[Prompt]]:
    """split ("train" | "test") -> its scenarios as prompts, oldest first. Cached per process: a closed window's
    traffic does not change (forgetting a person rewrites it; a process that trains on the old set finishes so)."""
    from storage.settings import Settings
    from storage.sql import Sandbox

    sql = (f"SELECT {COLUMNS} FROM traffic WHERE ($since IS NULL OR served_at >= $since) AND "
           f"($until IS NULL OR served_at < $until) AND ({where or 'TRUE'}) ORDER BY served_at, call_id")
    try:
        rows = Sandbox(Settings.from_env(workspace)).query(sql, {"since": since, "until": until}).to_pylist()
    except Exception as e:  # noqa: BLE001 - a bad filter is the config's problem, named
        raise TaskParamsError([f"task.params.where: the traffic query failed: {type(e).__name__}: {e}"]) from None
    key = "input_id" if agent else "scenario_id"
    first: dict[str, dict[str, Any]] = {}
    held: set[str] = set()
    for r in rows:
        if r[key] is None:  # an agent's scenario needs a user message to re-run on
            continue
        first.setdefault(r[key], r)
        if _hash(seed, "split", r["session_id"] or r["call_id"]) < test_fraction:
            held.add(r[key])
    splits: dict[str, list[Prompt]] = {"train": [], "test": []}
    for k, r in first.items():
        splits["test" if k in held else "train"].append(_prompt(k, r, agent))
    if max_scenarios is not None:
        for name, ps in splits.items():
            kept = set(sorted((p.prompt_id for p in ps), key=lambda pid: _hash(seed, "keep", pid))[:max_scenarios])
            splits[name] = [p for p in ps if p.prompt_id in kept]
    return splits


def _hash(seed: int, purpose: str, text: str) -> float:
    return int(hashlib.sha256(f"{seed}:{purpose}:{text}".encode()).hexdigest()[:8], 16) / 2**32


def _prompt(key: str, row: dict[str, Any], agent: bool) -> Prompt:
    """A scenario as a prompt: the conversation as chat messages (assistant turns as their raw text, tool calls in
    it), or for an agent the first user message alone. Metadata: where it came from (no person's ids)."""
    messages = [{k: v for k, v in (("role", m["role"]), ("content", m["content"] or ""), ("tool_call_id", m["tool_call_id"]),
                                   ("name", m["name"])) if v is not None} for m in row["messages"]]
    users = [m["content"] for m in messages if m["role"] == "user"]
    meta = {"source_call": row["call_id"], "served_at": row["served_at"].isoformat()}
    if agent:
        return Prompt(key, users[0], meta)
    return Prompt(key, users[-1] if users else "", meta, messages=tuple(messages))


def in_workspace(params: dict[str, Any], workspace: str) -> dict[str, Any]:
    """A traffic task's params with the run's workspace filled in (unless they name one)."""
    return {**params, "workspace": params.get("workspace") or workspace}


def closed(params: dict[str, Any], until: datetime) -> dict[str, Any]:
    """A traffic task's params with the window's end fixed at `until` unless they give one: every process of a run
    then reads the same scenarios, however much traffic arrives meanwhile."""
    return {**params, "until": params.get("until") or until.isoformat()}
