"""Episodes as MLflow traces (MLflow 3 Tracing): where people already look at agent runs, in `rlops ui mlflow`.

    traced = trace_served(ws, rows, run_id)       # traffic rows: a trace per served episode, a span per call
    traced = trace_rollouts(ws, rollouts, run_id)  # rollouts: a trace per episode, a span per model turn and tool call
    removed = delete_traces(ws, {"rlops.user_sha256": digest})   # forgetting a person (storage/forget.py)

A served episode's trace has an AGENT root span, an LLM span per call (its conversation in, its reply out, its
policy, tokens and latency as attributes, timed as it was served) and a TOOL span per tool result the client sent
back in the next call. A trained episode's has an LLM span per assistant turn and a TOOL span per tool call (its
arguments in, its result out). Traces are linked to the MLflow run that made them (the night's parent run) and
tagged with what SQL knows them by: `rlops.kind` (served | trained), `rlops.episode_id`, `rlops.session_id`,
`rlops.scenario_id` (the prompt id), `rlops.policy_id`, and a person only as `rlops.user_sha256`, never the id.

The driver writes them (the nightly loop, after its window is trained), not the server: a server writing SQLite
beside a pipeline would contend for its lock on every call, and a trace is for reading after the fact. MLflow's
tracing exports to the process's global tracking URI, whatever client starts a trace: `_exporting` points it at the
workspace's for the duration (one exporter at a time) and waits for the export queue before giving it back
(~65 ms a trace of a few spans, measured on this machine kind).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from storage.schema import Rollout
    from storage.workspace import Workspace

PREVIEW = 4000  # characters of a span's text kept in its inputs/outputs: a trace is for reading, the data is Parquet


_EXPORT = threading.Lock()
URI_VARIABLE = "MLFLOW_TRACKING_URI"


@contextmanager
def _exporting(ws: Workspace) -> Iterator[Any]:
    """The workspace's MLflow client, with MLflow's trace export pointed at its store until every trace started in
    the block is written."""
    import mlflow

    client = ws.tracker.client
    with _EXPORT:
        before, env = mlflow.get_tracking_uri(), os.environ.get(URI_VARIABLE)
        mlflow.set_tracking_uri(ws.settings.mlflow_uri)
        try:
            yield client
        finally:
            mlflow.flush_trace_async_logging()
            mlflow.set_tracking_uri(before)
            # set_tracking_uri also exports the variable, which Settings reads: a workspace opened later must not
            # find this one's store (or the default) named there
            os.environ.pop(URI_VARIABLE, None) if env is None else os.environ.__setitem__(URI_VARIABLE, env)


def user_digest(user_id: str) -> str:
    """How a trace names a person: sha256 of the id (what `rlops traffic forget --user` searches by)."""
    return hashlib.sha256(user_id.encode()).hexdigest()


def _ns(t: datetime) -> int:
    return int(t.timestamp() * 1e9)


def _cut(text: str | None) -> str:
    text = text or ""
    return text if len(text) <= PREVIEW else text[:PREVIEW] + f"... [{len(text) - PREVIEW} more characters]"


def _messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [{"role": m["role"], "content": _cut(m.get("content"))} for m in messages]


def trace_served(ws: Workspace, rows: list[dict[str, Any]], run_id: str | None = None) -> list[str]:
    """One trace per served episode of `rows` (traffic rows; calls without an episode are traced alone); returns the
    trace ids. Episodes already traced (a resumed night) are not traced again."""
    episodes: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in sorted(rows, key=lambda r: r["served_at"]):
        episodes[r["episode_id"] or r["call_id"]].append(r)
    done = _traced(ws, "served", list(episodes))
    with _exporting(ws) as client:
        return [_served(client, ws.tracker.experiment_id, run_id, episode, calls) for episode, calls in episodes.items()
                if episode not in done]


def _served(client: Any, experiment: str, run_id: str | None, episode: str, calls: list[dict[str, Any]]) -> str:
    """The trace of one served episode (its calls in order); returns its id."""
    first, last = calls[0], calls[-1]
    user = first["user_id"]
    tags = {"rlops.kind": "served", "rlops.episode_id": episode, "rlops.session_id": first["session_id"] or episode,
            "rlops.scenario_id": first["scenario_id"], "rlops.policy_id": first["policy_id"],
            **({"rlops.user_sha256": user_digest(user)} if user else {})}
    root = client.start_trace(f"served {episode}", span_type="AGENT", experiment_id=experiment, run_id=run_id,
                              inputs={"messages": _messages(first["messages"])}, tags=tags,
                              start_time_ns=_ns(first["served_at"]))
    end = first["served_at"].timestamp()
    for k, call in enumerate(calls):
        start = call["served_at"].timestamp()
        for m in _tool_results(call["messages"]) if k else []:
            tool = client.start_span(m.get("name") or "tool", trace_id=root.trace_id, parent_id=root.span_id,
                                     span_type="TOOL", inputs={"tool_call_id": m.get("tool_call_id")},
                                     start_time_ns=int(start * 1e9) - 1000)
            client.end_span(root.trace_id, tool.span_id, outputs={"result": _cut(m["content"])},
                            end_time_ns=int(start * 1e9))
        span = client.start_span(call["model"], trace_id=root.trace_id, parent_id=root.span_id, span_type="LLM",
                                 inputs={"messages": _messages(call["messages"])}, start_time_ns=int(start * 1e9),
                                 attributes={"policy_id": call["policy_id"], "api": call["api"],
                                             "prompt_tokens": call["prompt_tokens"],
                                             "completion_tokens": call["completion_tokens"], "call_id": call["call_id"]})
        end = start + (call["latency_s"] or 0.0)
        client.end_span(root.trace_id, span.span_id, outputs={"reply": _cut(call["reply"]),
                                                               "finish_reason": call["finish_reason"]},
                        end_time_ns=int(end * 1e9))
    client.end_trace(root.trace_id, outputs={"reply": _cut(last["reply"])}, end_time_ns=int(end * 1e9))
    return root.trace_id


def _tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool messages at the end of a conversation: the results of the previous reply's tool calls."""
    tail = []
    for m in reversed(messages):
        if m["role"] != "tool":
            break
        tail.append(m)
    return tail[::-1]


def trace_rollouts(ws: Workspace, rollouts: list[Rollout], run_id: str | None = None) -> list[str]:
    """One trace per rollout (a trained episode): an LLM span per assistant turn, a TOOL span per tool call, spread
    over the episode's generation time; returns the trace ids. Rollouts already traced are skipped."""
    done = _traced(ws, "trained", [r.rollout_id for r in rollouts])
    with _exporting(ws) as client:
        return [_trained(client, ws.tracker.experiment_id, run_id, r) for r in rollouts if r.rollout_id not in done]


def _trained(client: Any, experiment: str, run_id: str | None, r: Rollout) -> str:
    """The trace of one rollout; returns its id."""
    turns = [m for m in r.messages if m.role in ("assistant", "tool")]
    step = max(r.gen_seconds, 1e-3) / max(len(turns), 1)
    t = _ns(r.created_at) - int(r.gen_seconds * 1e9)
    opening = [m for m in r.messages if m.role in ("system", "user")][:2]
    root = client.start_trace(f"rollout {r.rollout_id}", span_type="AGENT", experiment_id=experiment, run_id=run_id,
                              inputs={"messages": _messages([{"role": m.role, "content": m.content} for m in opening])},
                              start_time_ns=t, tags={"rlops.kind": "trained", "rlops.episode_id": r.rollout_id,
                                                     "rlops.scenario_id": r.prompt_id, "rlops.policy_id": r.policy_id,
                                                     "rlops.batch_id": r.batch_id})
    calls = {c.id: c for m in r.messages for c in m.tool_calls}
    for k, m in enumerate(turns):
        kind = "LLM" if m.role == "assistant" else "TOOL"
        call = calls.get(m.tool_call_id or "")
        inputs = {"arguments": call.arguments if call else None} if kind == "TOOL" else {"turn": k}
        span = client.start_span(m.name or ("tool" if kind == "TOOL" else r.policy_id), trace_id=root.trace_id,
                                 parent_id=root.span_id, span_type=kind, inputs=inputs, start_time_ns=t)
        t += int(step * 1e9)
        client.end_span(root.trace_id, span.span_id, outputs={"content": _cut(m.content),
                                                               "tool_calls": [c.name for c in m.tool_calls]},
                        end_time_ns=t)
    client.end_trace(root.trace_id, outputs={"finish_reason": r.finish_reason, "num_turns": r.num_turns},
                     end_time_ns=t)
    return root.trace_id


def _traced(ws: Workspace, kind: str, episodes: list[str]) -> set[str]:
    """Which of `episodes` already have a trace of `kind`."""
    if not episodes:
        return set()
    wanted, found = set(episodes), set()
    for t in search(ws, {"rlops.kind": kind}):
        episode = t.info.tags.get("rlops.episode_id")
        if episode in wanted:
            found.add(episode)
    return found


def search(ws: Workspace, tags: dict[str, str]) -> list[Any]:
    """The traces (without their spans) carrying every tag in `tags`."""
    client = ws.tracker.client
    where = " AND ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items() if _plain(k) and _plain(v))
    out, token = [], None
    while True:
        page = client.search_traces(locations=[ws.tracker.experiment_id], filter_string=where or None,
                                    include_spans=False, max_results=500, page_token=token)
        out += list(page)
        token = getattr(page, "token", None)
        if not token:
            return out


def _plain(text: str) -> bool:
    """A tag key or value rlops writes (ids, hashes): safe inside an MLflow filter string, which takes no parameters."""
    if not all(c.isalnum() or c in "._-@:" for c in text):
        raise ValueError(f"not an id rlops writes: {text!r}")
    return True


def delete_traces(ws: Workspace, trace_ids: list[str]) -> int:
    """Delete traces, their span files, and the bytes SQLite kept of them (VACUUM): what forgetting needs."""
    if not trace_ids:
        return 0
    client = ws.tracker.client
    deleted = client.delete_traces(ws.tracker.experiment_id, trace_ids=trace_ids)
    location = Path(ws.settings.mlflow_artifacts)
    for trace_id in trace_ids:  # MLflow leaves some span files behind
        for folder in location.glob(f"*/traces/{trace_id}") if location.is_dir() else []:
            shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(location / "traces" / trace_id, ignore_errors=True)
    uri = ws.settings.mlflow_uri
    if uri.startswith("sqlite:///"):
        import sqlite3

        with sqlite3.connect(uri.removeprefix("sqlite:///"), timeout=60) as con:
            con.execute("VACUUM")
    return int(deleted or 0)

