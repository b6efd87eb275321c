"""Fixtures for reward tests: a Rollout builder and a real chat-completions HTTP server on 127.0.0.1."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from storage.schema import Message, Rollout

SYSTEM = Message("system", "Answer the question. Tools: search(query), read(doc_id).")
USER = Message("user", "What is 40 + 42?")


def build_rollout(
    messages: list[Message],
    metadata: dict[str, Any] | None = None,
    group_id: str = "g0",
    sample_idx: int = 0,
    loss_mask: list[int] | None = None,
) -> Rollout:
    """A Rollout with the given conversation (after a fixed system + user opening) and ground truth."""
    msgs = [SYSTEM, USER, *messages]
    mask = loss_mask if loss_mask is not None else [1] * 10
    return Rollout(
        rollout_id=f"{group_id}-{sample_idx}",
        batch_id="b0",
        policy_id="p0",
        task="arithmetic",
        split="train",
        prompt_id=group_id,
        group_id=group_id,
        sample_idx=sample_idx,
        messages=msgs,
        token_ids=list(range(len(mask))),
        loss_mask=mask,
        behavior_logprobs=[0.0] * len(mask),
        num_turns=sum(m.role == "assistant" for m in msgs),
        num_tool_calls=sum(len(m.tool_calls) for m in msgs),
        finish_reason="answer",
        truncated=False,
        metadata=metadata or {},
        sampling={},
        seed=0,
        gen_seconds=0.0,
    )


@pytest.fixture
def make_rollout() -> Callable[..., Rollout]:
    return build_rollout


# A scripted reply: (HTTP status, body: dict sent as JSON or str sent as is, seconds to wait first).
Reply = tuple[int, Any, float]


def chat_reply(content: str, prompt_tokens: int = 10, completion_tokens: int = 5) -> Reply:
    """A 200 chat-completions reply carrying `content`."""
    body = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
    }
    return 200, body, 0.0


@dataclass
class JudgeServer:
    """A real HTTP server speaking POST /v1/chat/completions; `respond(request_json, headers)` scripts it."""

    url: str = ""
    requests: list[dict[str, Any]] = field(default_factory=list)  # {"headers": {...}, "body": {...}}
    respond: Callable[[dict[str, Any], dict[str, str]], Reply] = lambda body, headers: (500, "unscripted", 0.0)
    in_flight: int = 0
    max_in_flight: int = 0  # the most requests being answered at once

    ok = staticmethod(chat_reply)

    def script(self, *replies: Reply) -> None:
        """Answer the next requests with `replies` in order (the last one repeats)."""
        queue = list(replies)
        self.respond = lambda body, headers: queue.pop(0) if len(queue) > 1 else queue[0]


@pytest.fixture
def judge_server() -> Iterator[JudgeServer]:
    state = JudgeServer()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            headers = {k.lower(): v for k, v in self.headers.items()}
            with lock:
                state.requests.append({"path": self.path, "headers": headers, "body": body})
                status, payload, delay = state.respond(body, headers)
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
            time.sleep(delay)
            with lock:
                state.in_flight -= 1
            data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (timeout test): nothing to answer

        def log_message(self, *args: Any) -> None:
            pass  # keep test output quiet

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True  # a handler still sleeping in the timeout test must not block shutdown
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    yield state
    server.shutdown()
    server.server_close()
