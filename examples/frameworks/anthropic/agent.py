"""The doc_search agent written with Anthropic's `anthropic` SDK (the Messages API), plain or streamed.

    rlops run configs/doc_search_agent.yaml --set task.params.entry=examples/frameworks/anthropic/agent.py:rollout
    rlops run configs/doc_search_agent.yaml --set task.params.entry=examples/frameworks/anthropic/agent.py:rollout_streamed

The SDK takes the server's root URL and adds `/v1/messages` itself: it is given the episode's URL
without its `/v1` (`.../ep/{episode_id}`), which files every call under the episode. The loop is the
SDK docs' tool loop: the response's content blocks go back as the assistant turn, each `tool_use`
is answered by a `tool_result`, until `stop_reason` is not "tool_use". The conversation is returned
in the Messages API's shape (the SDK's block objects included); rlops reads it (tasks/histories.py).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import anthropic


def _doc_search() -> Any:
    """examples/doc_search_openai/agent.py: the knowledge base, its tools and the system prompt."""
    name = "rlops_example_doc_search"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[2] / "doc_search_openai" / "agent.py")
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


kb = _doc_search()
TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
          "input_schema": t["function"]["parameters"]} for t in kb.TOOLS]  # Anthropic's tool shape
MAX_TOKENS = 1024  # required by the Messages API; a rollout caps it at its max_new_tokens


async def _turn(client: anthropic.AsyncAnthropic, model: str, messages: list[dict[str, Any]], streamed: bool) -> Any:
    ask = dict(model=model, max_tokens=MAX_TOKENS, system=kb.SYSTEM_PROMPT, tools=TOOLS, messages=messages)
    if not streamed:
        return await client.messages.create(**ask)
    async with client.messages.stream(**ask) as stream:
        async for _ in stream.text_stream:  # an agent showing the answer as it is written would print here
            pass
        return await stream.get_final_message()


async def _run(endpoint: Any, prompt: str, streamed: bool) -> dict[str, Any]:
    client = anthropic.AsyncAnthropic(base_url=endpoint.base_url.removesuffix("/v1"), api_key=endpoint.api_key,
                                      default_headers=endpoint.headers, max_retries=0, timeout=endpoint.timeout)
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    try:
        for turn in range(kb.MAX_TURNS):
            try:
                response = await _turn(client, endpoint.model, messages, streamed)
            except anthropic.BadRequestError:  # the conversation outgrew the model's context: stop here
                break
            messages.append({"role": "assistant", "content": response.content})
            if response.stop_reason != "tool_use" or turn == kb.MAX_TURNS - 1:
                break
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": block.id, "content": kb.run_tool(block.name, json.dumps(block.input))}
                for block in response.content if block.type == "tool_use"]})
    finally:
        await client.close()
    return {"messages": messages}


async def rollout(endpoint: Any, prompt: str) -> dict[str, Any]:
    """One question with `messages.create`; the conversation in the Messages API's shape."""
    return await _run(endpoint, prompt, streamed=False)


async def rollout_streamed(endpoint: Any, prompt: str) -> dict[str, Any]:
    """One question with `messages.stream` (Server-Sent Events); the same conversation."""
    return await _run(endpoint, prompt, streamed=True)
