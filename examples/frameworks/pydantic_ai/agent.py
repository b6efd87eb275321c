"""The doc_search agent written with pydantic-ai (an Agent on OpenAIChatModel).

    rlops run configs/doc_search_agent.yaml --set task.params.entry=examples/frameworks/pydantic_ai/agent.py:rollout

pydantic-ai takes an openai client through its provider: the endpoint makes one. The run's messages
(ModelRequest / ModelResponse) are returned as they are: rlops converts them.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.exceptions import UsageLimitExceeded
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import UsageLimits


def _doc_search() -> Any:
    """examples/doc_search_openai/agent.py: the knowledge base, its tools and the system prompt."""
    name = "rlops_example_doc_search"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[2] / "doc_search_openai" / "agent.py")
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


kb = _doc_search()


def search(query: str) -> str:
    """Search the knowledge base; returns the best matches as 'doc_id: title — first sentence'.

    Args:
        query: a few keywords, e.g. a name
    """
    return kb.search(query)


def read(doc_id: str) -> str:
    """Read the full text of one document by its id.

    Args:
        doc_id: an id returned by search
    """
    return kb.read(doc_id)


async def rollout(endpoint: Any, prompt: str) -> dict[str, Any] | None:
    """One question; the run's messages in pydantic-ai's own types."""
    model = OpenAIChatModel(endpoint.model, provider=OpenAIProvider(openai_client=endpoint.async_client()))
    agent = Agent(model, instructions=kb.SYSTEM_PROMPT, tools=[search, read])
    try:
        result = await agent.run(prompt, usage_limits=UsageLimits(request_limit=kb.MAX_TURNS))
    except UsageLimitExceeded:
        return None  # out of turns: the service's record of the episode stands
    return {"messages": result.all_messages()}
