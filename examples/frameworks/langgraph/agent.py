"""The doc_search agent written with LangChain's `create_agent` (a LangGraph graph: model and tools
nodes in a loop; it replaces the deprecated `langgraph.prebuilt.create_react_agent`) on langchain-openai's
ChatOpenAI.

Trained unchanged by rlops (the entry's endpoint form, docs/TASKS.md "Framework agents"):

    rlops run configs/doc_search_agent.yaml --set task.params.entry=examples/frameworks/langgraph/agent.py:rollout

The entry gets the episode's endpoint (`base_url` already names the episode: /ep/{id}/v1) and returns
the graph's final state, whose `messages` are LangChain messages: rlops converts them. No rlops import.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from langchain.agents import create_agent
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError


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
    """Search the knowledge base; returns the best matches as 'doc_id: title — first sentence'."""
    return kb.search(query)


@tool
def read(doc_id: str) -> str:
    """Read the full text of one document by its id."""
    return kb.read(doc_id)


async def rollout(endpoint: Any, prompt: str) -> dict[str, Any] | None:
    """One question; the graph's final state (its `messages`: HumanMessage, AIMessage, ToolMessage)."""
    llm = ChatOpenAI(model=endpoint.model, base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    agent = create_agent(llm, [search, read], system_prompt=kb.SYSTEM_PROMPT)
    try:
        # A model step and a tool step per turn: the same budget as the plain example's MAX_TURNS.
        return await agent.ainvoke({"messages": [{"role": "user", "content": prompt}]},
                                   {"recursion_limit": 2 * kb.MAX_TURNS})
    except GraphRecursionError:
        return None  # out of turns: the service's record of the episode stands
