"""An agent service in another process for tests/stages/service/test_agent_service.py: the url-agent
protocol of tasks/agent.py over Python's own http.server, with the scripted agent of agents_for_tests.

    python agent_service_for_tests.py --port P

POST /rollout {prompt_id, prompt, base_url, model, episode_id}: by the prompt text,
  "fail" -> HTTP 500, "garbage" -> a reply that is not JSON, "slow" -> sleeps 600 s, "list" -> a JSON list,
  "noheader" / "wrongmodel" -> one call without the episode header / naming model "gpt-4o", then {metadata},
  anything else -> the scripted episode (search, the scripted result, answer) with the episode header,
  answered with {messages, metadata: {completion_tokens, base_url}}.
GET /version -> "py-agent-1".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import openai  # noqa: E402

from tests.scripted_model import QUESTION, SYSTEM, TOOL_RESULT, TOOLS  # noqa: E402


def astray(body: dict) -> dict:
    """A call never recorded under the episode: no episode header ("noheader") or an unknown model."""
    headers = {} if body["prompt"] == "noheader" else {"X-Episode-Id": body["episode_id"]}
    client = openai.OpenAI(base_url=body["base_url"], api_key="unused", max_retries=0, default_headers=headers)
    model = body["model"] if body["prompt"] == "noheader" else "gpt-4o"
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    except openai.NotFoundError:
        pass
    return {"metadata": {"astray": body["prompt"]}}


def episode(body: dict) -> dict:
    client = openai.OpenAI(base_url=body["base_url"], api_key="unused", max_retries=0,
                           default_headers={"X-Episode-Id": body["episode_id"]})
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    completion_tokens = 0
    for _ in range(3):
        response = client.chat.completions.create(model=body["model"], messages=messages, tools=TOOLS)
        completion_tokens += response.usage.completion_tokens
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT})
    return {"messages": messages, "metadata": {"completion_tokens": completion_tokens, "base_url": body["base_url"]}}


class Handler(BaseHTTPRequestHandler):
    def _send(self, status: int, text: str, kind: str = "application/json") -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._send(200, "py-agent-1", "text/plain") if self.path == "/version" else self._send(404, "{}")

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["prompt"]
        if prompt == "fail":
            return self._send(500, json.dumps({"error": "the agent's own bug"}))
        if prompt == "garbage":
            return self._send(200, "<html>not json</html>", "text/html")
        if prompt == "list":
            return self._send(200, json.dumps([1, 2]))
        if prompt in ("noheader", "wrongmodel"):
            return self._send(200, json.dumps(astray(body)))
        if prompt == "slow":
            time.sleep(600)
        return self._send(200, json.dumps(episode(body)))

    def log_message(self, *args: object) -> None:
        pass


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer(("127.0.0.1", parser.parse_args().port), Handler).serve_forever()
