"""External agents used by tests/stages/test_external.py: plain OpenAI-client code, like a user's."""

from __future__ import annotations

from typing import Any

import openai

from rewards.base import reward
from storage.schema import Rollout
from tests.scripted_model import QUESTION, SYSTEM, TOOL_RESULT, TOOLS


async def scripted(client: openai.AsyncOpenAI, model: str, prompt: str) -> dict[str, Any]:
    """Ask, run the tool call with the scripted result, return the conversation and a metadata field."""
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    for _ in range(3):
        response = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        message = response.choices[0].message
        messages.append(message)  # the client's own message object, as many agents append it
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT})
    return {"messages": messages, "metadata": {"prompt_seen": prompt}}


async def rewriting(client: openai.AsyncOpenAI, model: str, prompt: str) -> None:
    """Search, then replace the call and its result by a summary (history rewriting), then answer."""
    opening = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    await client.chat.completions.create(model=model, messages=opening, tools=TOOLS)
    summary = [opening[0], {"role": "user", "content": f"{QUESTION}\nA search returned: {TOOL_RESULT}"}]
    await client.chat.completions.create(model=model, messages=summary, tools=TOOLS)
    return None  # the service's record of the last call is the conversation


async def flaky(client: openai.AsyncOpenAI, model: str, prompt: str) -> dict[str, Any]:
    """One model call, then raise on prompts whose id-like text says so."""
    response = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=4)
    if "fail" in prompt:
        raise RuntimeError(f"the agent's own bug on {prompt!r}")
    return {"messages": [{"role": "user", "content": prompt}, response.choices[0].message]}


def not_async(client: Any, model: str, prompt: str) -> None:
    """Not a coroutine function: refused when the task is built."""


@reward(low=0.0, high=1.0)
def odd_answer_length(rollout: Rollout) -> float:
    """A reward with variance on a random tiny model's output (1 if the last message's text has an
    odd length), so a GRPO step on it has groups with signal."""
    return float(len(rollout.messages[-1].content or "") % 2)
