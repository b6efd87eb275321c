"""A scripted judge for arithmetic: a real chat-completions server on 127.0.0.1 that reads the judge requests rlops
sends (rewards/judge_request.py: the shared context once, trajectories labelled 1..n) and judges each trajectory's
last answer by doing the sum in the question itself (no reference is sent: the judges of the deployment loop have
none). It answers RULER's ranking requests with a scores JSON and the pairwise mode's first-token requests with
log-probs, like any OpenAI-compatible server.

    with arithmetic_judge() as judge:      # judge.url: the base URL; judge.requests: what it was asked
        ...
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

QUESTION = re.compile(r"What is (\d+) ([+-]) (\d+)\?")


@dataclass
class Judge:
    url: str = ""
    requests: list[dict[str, Any]] = field(default_factory=list)


def truth(text: str) -> int | None:
    m = QUESTION.search(text)
    if m is None:
        return None
    a, op, b = int(m[1]), m[2], int(m[3])
    return a + b if op == "+" else a - b


def _right(question: str, body: list[dict[str, Any]]) -> bool:
    answers = [m.get("content") or "" for m in body if m.get("role") == "assistant"]
    return bool(answers) and answers[-1].strip() == str(truth(question))


def verdict(body: dict[str, Any]) -> dict[str, Any]:
    """The reply to one judge request: RULER scores, or (max_tokens 1 with log-probs) the pairwise first token."""
    text = body["messages"][-1]["content"]
    context = re.search(r"<context>\n(.*?)\n</context>", text, re.DOTALL)
    shared = json.loads(context[1]) if context else []
    bodies = [json.loads(b) for b in re.findall(r'<trajectory id="\d+">\n(.*?)\n</trajectory>', text, re.DOTALL)]
    question = " ".join(m.get("content") or "" for m in shared if m.get("role") == "user")
    right = [_right(question or json.dumps(b), b) for b in bodies]
    if body.get("logprobs"):  # pairwise: "1" when trajectory 1 is right and 2 is not, even when both are alike
        p = 0.5 if right[0] == right[1] else (0.95 if right[0] else 0.05)
        top = [{"token": "1", "logprob": math.log(p)}, {"token": "2", "logprob": math.log(1 - p)}]
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "1"}, "finish_reason": "length",
                             "logprobs": {"content": [{"token": "1", "logprob": math.log(p), "top_logprobs": top}]}}],
                "usage": {"prompt_tokens": len(text) // 4, "completion_tokens": 1}}
    scores = [{"id": str(i), "score": 1.0 if ok else 0.0, "explanation": "right" if ok else "wrong"}
              for i, ok in enumerate(right, 1)]
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": json.dumps({"scores": scores})},
                         "finish_reason": "stop"}], "usage": {"prompt_tokens": len(text) // 4, "completion_tokens": 20}}


@contextmanager
def arithmetic_judge() -> Iterator[Judge]:
    judge, lock = Judge(), threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                judge.requests.append(body)
            data = json.dumps(verdict(body)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    judge.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        yield judge
    finally:
        server.shutdown()
        server.server_close()
