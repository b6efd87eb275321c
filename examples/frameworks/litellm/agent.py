"""The doc_search agent written with LiteLLM (`litellm.acompletion` on an OpenAI-compatible server).

    rlops run configs/doc_search_agent.yaml --set task.params.entry=examples/frameworks/litellm/agent.py:rollout

LiteLLM is given the endpoint's base URL (it names the episode) and `openai/<model>` (the
OpenAI-compatible provider). Its `Message` objects go into the returned conversation as LiteLLM's
docs append them. The rollout stage sets LITELLM_LOCAL_MODEL_COST_MAP=True before loading this file
(LiteLLM otherwise fetches its price map from GitHub at import).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import litellm


def _doc_search() -> Any:
    """examples/doc_search_openai/agent.py: the knowledge base, its tools and the system prompt."""
    name = "rlops_example_doc_search"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[2] / "doc_search_openai" / "agent.py")
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


kb = _doc_search()


async def rollout(endpoint: Any, prompt: str) -> dict[str, Any]:
    """One question; the conversation (dicts and litellm Message objects)."""
    messages: list[Any] = [{"role": "system", "content": kb.SYSTEM_PROMPT}, {"role": "user", "content": prompt}]
    for turn in range(kb.MAX_TURNS):
        try:
            response = await litellm.acompletion(model=f"openai/{endpoint.model}", api_base=endpoint.base_url,
                                                 api_key=endpoint.api_key, messages=messages, tools=kb.TOOLS,
                                                 num_retries=0)
        except litellm.BadRequestError:  # the conversation outgrew the model's context: stop here
            break
        message = response.choices[0].message
        messages.append(message)
        if not message.tool_calls or turn == kb.MAX_TURNS - 1:
            break
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                             "content": kb.run_tool(call.function.name, call.function.arguments)})
    return {"messages": messages}
