"""The doc_search agent written with smolagents (a ToolCallingAgent on OpenAIServerModel).

    rlops run configs/doc_search_agent.yaml --set task.params.entry=examples/frameworks/smolagents/agent.py:rollout

smolagents is synchronous and builds its own openai client from a base URL: the entry is a plain
`def` (rlops runs it in a thread per episode) taking the endpoint, whose `base_url` already names the
episode. It returns the agent's memory steps: rlops converts them to structured tool calls and tool
results, and smolagents' `final_answer` call to the answer it gives.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from smolagents import OpenAIServerModel, ToolCallingAgent, tool


def _doc_search() -> Any:
    """examples/doc_search_openai/agent.py: the knowledge base, its tools and the system prompt."""
    name = "rlops_example_doc_search"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[2] / "doc_search_openai" / "agent.py")
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


kb = _doc_search()


@tool
def search(query: str) -> str:
    """Search the knowledge base; returns the best matches as 'doc_id: title — first sentence'.

    Args:
        query: a few keywords, e.g. a name
    """
    return kb.search(query)


@tool
def read(doc_id: str) -> str:
    """Read the full text of one document by its id.

    Args:
        doc_id: an id returned by search
    """
    return kb.read(doc_id)


def rollout(endpoint: Any, prompt: str) -> dict[str, Any]:
    """One question (blocking); the agent's memory steps."""
    llm = OpenAIServerModel(model_id=endpoint.model, api_base=endpoint.base_url, api_key=endpoint.api_key,
                            client_kwargs={"max_retries": 0})
    agent = ToolCallingAgent(tools=[search, read], model=llm, instructions=kb.SYSTEM_PROMPT, max_steps=kb.MAX_TURNS,
                             verbosity_level=0)
    agent.run(prompt)
    return {"messages": agent.memory.steps}
