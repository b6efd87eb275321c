"""The doc_search agent of examples/doc_search_openai/agent.py, streaming every model call
(`stream: true`, deltas assembled by hand as a streaming agent does), for bench/bench_serve_stream.py.

Each call's time to first output (the first content or tool-call delta) and whether the turn had
text are appended as JSON lines to the file `$RLOPS_BENCH_TTFT_FILE` when it is set.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any

import openai

_PATH = Path(__file__).resolve().parents[1] / "examples" / "doc_search_openai" / "agent.py"
_SPEC = importlib.util.spec_from_file_location("doc_search_openai_agent", _PATH)
_AGENT = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_AGENT)


async def _streamed_turn(client: openai.AsyncOpenAI, model: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    t0 = time.perf_counter()
    first = None
    content, calls = "", {}
    stream = await client.chat.completions.create(model=model, messages=messages, tools=_AGENT.TOOLS, stream=True)
    async for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if first is None and (delta.content or delta.tool_calls):
            first = time.perf_counter() - t0
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
            call["id"] = tc.id or call["id"]
            call["function"]["name"] += (tc.function.name or "") if tc.function else ""
            call["function"]["arguments"] += (tc.function.arguments or "") if tc.function else ""
    if out := os.environ.get("RLOPS_BENCH_TTFT_FILE"):
        with open(out, "a") as f:
            f.write(json.dumps({"first_output_s": first, "total_s": time.perf_counter() - t0, "text": bool(content)}) + "\n")
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
    return message


async def rollout(client: openai.AsyncOpenAI, model: str, prompt: str) -> dict[str, Any]:
    """Answer one question as examples/doc_search_openai/agent.py does, every call streamed."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": _AGENT.SYSTEM_PROMPT},
                                      {"role": "user", "content": prompt}]
    for turn in range(_AGENT.MAX_TURNS):
        try:
            message = await _streamed_turn(client, model, messages)
        except openai.BadRequestError:  # the conversation outgrew the model's context: stop here
            break
        messages.append(message)
        if not message.get("tool_calls") or turn == _AGENT.MAX_TURNS - 1:
            break
        for call in message["tool_calls"]:
            messages.append({"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"],
                             "content": _AGENT.run_tool(call["function"]["name"], call["function"]["arguments"])})
    return {"messages": messages}
