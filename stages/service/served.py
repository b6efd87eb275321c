"""Who sent a call, and the call as the traffic log keeps it (storage/traffic.py).

    caller = Caller(episode="ep-1", api="chat", session="s-9", user="u-3", tags={"app": "web"})
    body = await service.chat_completion(request, caller)       # the service records its tokens under caller.episode
    row = traffic_row(call)                                     # what `rlops serve` writes for it (a `traffic` row)

The app (stages/service/app.py) fills a `Caller` from the route, the headers and the body: the episode as before (the
URL's /ep/{id}, else X-Episode-Id, else `user`), the session (X-Session-Id, else metadata.session_id, else the
episode), the person (X-User-Id, else metadata.user_id, else `user`) and the client's tags (the request's `metadata`
and the X-Rlops-Tags header, a JSON object). The service hands each answered call to its sink as a `ServedCall`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from stages.policy.sampling import Sample, SamplingConfig
from storage.schema import Message
from storage.traffic import content_key, input_key
from tasks.base import OPEN_TAG

SESSION_HEADER, USER_HEADER, TAGS_HEADER = "X-Session-Id", "X-User-Id", "X-Rlops-Tags"


@dataclass(frozen=True)
class Caller:
    """Who sent a call and how; `episode` files its tokens in the recorder (None: served, not recorded there)."""

    episode: str | None = None
    api: str = "chat"  # chat | completions | responses | messages
    stream: bool = False
    session: str | None = None
    user: str | None = None
    tags: dict[str, Any] = field(default_factory=dict)
    arrived: float = field(default_factory=time.time)  # wall clock, for `served_at`
    started: float = field(default_factory=time.monotonic)  # for the latency


def caller(*, episode: str | None, api: str, stream: bool, user_field: str | None, metadata: dict[str, Any] | None,
           headers: Any) -> Caller:
    """The caller of a request, from its episode id (already found by the app), `user` field, `metadata` and headers.
    A malformed X-Rlops-Tags header is kept as the text it is (`{"header": ...}`): tags are the client's, never
    a reason to refuse a call."""
    metadata = metadata or {}
    tags: dict[str, Any] = dict(metadata)
    if raw := headers.get(TAGS_HEADER):
        try:
            parsed = json.loads(raw)
            tags.update(parsed if isinstance(parsed, dict) else {"header": raw})
        except ValueError:
            tags["header"] = raw
    session = headers.get(SESSION_HEADER) or _text(metadata.get("session_id")) or episode
    user = headers.get(USER_HEADER) or _text(metadata.get("user_id")) or user_field
    return Caller(episode=episode, api=api, stream=stream, session=session, user=user, tags=tags)


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


@dataclass
class ServedCall:
    """One answered call, as the service saw it: what the sink of `rlops serve` writes (`traffic_row`)."""

    caller: Caller
    call_id: str
    model: str  # as the request named it
    policy_id: str
    seen: list[Message]  # the conversation as the model saw it
    tools: list[dict[str, Any]] | None
    prompt_ids: list[int]
    sample: Sample  # the first choice
    finish_reason: str
    n: int
    sampling: SamplingConfig
    seed: int | None


def traffic_row(call: ServedCall, registry: tuple[str, str, str] | None = None) -> dict[str, Any]:
    """The `traffic` row of a call (storage/loop_schema.py); `registry`: (model, alias, version) when the request
    named a registered model's alias or version."""
    messages = [asdict(m) for m in call.seen]
    s, c = call.sample, call.caller
    return {
        "call_id": call.call_id, "served_at": datetime.fromtimestamp(c.arrived, timezone.utc),
        "latency_s": time.monotonic() - c.started, "api": c.api, "stream": c.stream, "episode_id": c.episode,
        "session_id": c.session, "user_id": c.user, "model": call.model, "policy_id": call.policy_id,
        "registry_model": registry[0] if registry else None, "registry_alias": registry[1] if registry else None,
        "registry_version": registry[2] if registry else None, "messages": messages,
        "tools": json.dumps(call.tools) if call.tools else None, "reply": s.text,
        "reply_tool_calls": s.text.count(OPEN_TAG) if call.tools else 0,  # parsed as calls only when tools were offered
        "finish_reason": call.finish_reason, "n": call.n,
        "prompt_token_ids": call.prompt_ids, "token_ids": s.token_ids, "logprobs": s.logprobs,
        "prompt_tokens": len(call.prompt_ids), "completion_tokens": len(s.token_ids),
        "sampling": json.dumps({"temperature": call.sampling.temperature, "top_p": call.sampling.top_p,
                                "max_tokens": call.sampling.max_new_tokens, "seed": call.seed}),
        "tags": json.dumps(c.tags, default=str) if c.tags else None,
        "scenario_id": content_key(messages), "input_id": input_key(messages),
    }
