"""External agents used by tests/stages/service/test_external.py: plain OpenAI-client code, like a user's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai

from rewards.base import reward
from storage.schema import Rollout
from tasks.agent import Endpoint
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


async def astray(client: openai.AsyncOpenAI, model: str, prompt: str) -> dict[str, Any]:
    """Calls the model but never under its episode: by the prompt, with a client of its own built without
    the episode header ("own client"), or naming a model the rollout does not serve ("wrong model",
    the error swallowed as a careless agent does). Neither may become an empty 'answer'."""
    messages = [{"role": "user", "content": prompt}]
    if prompt == "own client":
        async with openai.AsyncOpenAI(base_url=str(client.base_url), api_key="x", max_retries=0) as own:
            response = await own.chat.completions.create(model=model, messages=messages, max_tokens=4)
        return {"messages": messages + [response.choices[0].message]}
    try:
        await client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=4)
    except openai.NotFoundError:
        pass
    return {"messages": messages}


async def endpoint_async(endpoint: Endpoint, prompt: str) -> dict[str, Any]:
    """The endpoint form: one call through the Endpoint's own client, its completion tokens reported."""
    messages = [{"role": "user", "content": prompt}]
    async with endpoint.async_client() as client:
        response = await client.chat.completions.create(model=endpoint.model, messages=messages, max_tokens=6)
    return {"messages": messages + [response.choices[0].message],
            "metadata": {"completion_tokens": response.usage.completion_tokens}}


def endpoint_sync(endpoint, prompt):  # noqa: ANN001, ANN201 - no annotation, no rlops import: found by its name
    """A sync entry (as smolagents agents are) given only the bare episode URL: two calls, no header."""
    client = openai.OpenAI(base_url=endpoint.base_url, api_key="anything", max_retries=0)
    messages, tokens = [{"role": "user", "content": prompt}], 0
    for _ in range(2):
        response = client.chat.completions.create(model=endpoint.model, messages=messages, max_tokens=5)
        tokens += response.usage.completion_tokens
        messages += [response.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    return {"messages": messages[:-1], "metadata": {"completion_tokens": tokens}}


async def two_params(client: openai.AsyncOpenAI, prompt: str) -> None:
    """Neither form: refused when the task is built."""


async def endpoint_three(endpoint: Endpoint, prompt: str, extra: str) -> None:
    """The endpoint form with a third required parameter: refused."""


def not_async(client: Any, model: str, prompt: str) -> None:
    """Not a coroutine function: refused when the task is built."""


@reward(low=0.0, high=1.0)
def odd_answer_length(rollout: Rollout) -> float:
    """A reward with variance on a random tiny model's output (1 if the last message's text has an
    odd length), so a GRPO step on it has groups with signal."""
    return float(len(rollout.messages[-1].content or "") % 2)


EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "doc_search_openai"


def example_pipeline_config(model_dir: Path, name: str, eval_every: int) -> dict[str, Any]:
    """A 2-step pipeline of the OpenAI doc_search example on a tiny model. It trains on `odd_answer_length`
    (a tiny random model answers nothing right, so `correct` would give no signal) and evaluates `correct`."""
    return {
        "name": name, "base_model": str(model_dir),
        "task": {"name": "agent", "params": {"entry": f"{EXAMPLE / 'agent.py'}:rollout",
                                             "prompts": str(EXAMPLE / "prompts.jsonl")}},
        "steps": 2,
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8, "max_total_tokens": 512},
        "score": {"rewards": [{"name": "correct", "fn": "rewards.builtin.exact_match", "params": {"mode": "contains"}},
                              {"name": "odd", "fn": "tests.stages.service.agents_for_tests.odd_answer_length"}],
                  "total": None},
        "train_reward": "odd",
        "eval": {"n_prompts": 2, "every": eval_every, "metric": "correct"},
    }
