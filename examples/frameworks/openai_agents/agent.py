"""The doc_search agent written with the OpenAI Agents SDK, on the Chat Completions model (`rollout`)
or the SDK's default, the Responses API (`rollout_responses`).

    rlops run configs/doc_search_agent.yaml --set task.params.entry=examples/frameworks/openai_agents/agent.py:rollout
    rlops run configs/doc_search_agent.yaml --set task.params.entry=examples/frameworks/openai_agents/agent.py:rollout_responses

The SDK takes an openai client: the endpoint makes one. The run's result is returned as it is (rlops
reads its `to_input_list()`). The rollout stage sets OPENAI_AGENTS_DISABLE_TRACING=1 before loading
this file (the SDK otherwise exports traces to api.openai.com when an OpenAI key is set).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from agents import (Agent, MaxTurnsExceeded, ModelBehaviorError, OpenAIChatCompletionsModel, OpenAIResponsesModel,
                    Runner, function_tool)


def _doc_search() -> Any:
    """examples/doc_search_openai/agent.py: the knowledge base, its tools and the system prompt."""
    name = "rlops_example_doc_search"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[2] / "doc_search_openai" / "agent.py")
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


kb = _doc_search()


@function_tool
def search(query: str) -> str:
    """Search the knowledge base; returns the best matches as 'doc_id: title — first sentence'.

    Args:
        query: a few keywords, e.g. a name
    """
    return kb.search(query)


@function_tool
def read(doc_id: str) -> str:
    """Read the full text of one document by its id.

    Args:
        doc_id: an id returned by search
    """
    return kb.read(doc_id)


async def _run(endpoint: Any, prompt: str, model_class: type) -> Any:
    agent = Agent(name="doc_search", instructions=kb.SYSTEM_PROMPT, tools=[search, read],
                  model=model_class(model=endpoint.model, openai_client=endpoint.async_client()))
    try:
        return await Runner.run(agent, prompt, max_turns=kb.MAX_TURNS)
    except (MaxTurnsExceeded, ModelBehaviorError):
        # Out of turns, or a turn the SDK refuses (a Responses turn cut at max_new_tokens is "incomplete",
        # a malformed tool call): what the policy did is still its behaviour, to be scored, so the
        # service's record of the episode stands rather than an error row.
        return None


async def rollout(endpoint: Any, prompt: str) -> Any:
    """One question over /v1/chat/completions; the RunResult."""
    return await _run(endpoint, prompt, OpenAIChatCompletionsModel)


async def rollout_responses(endpoint: Any, prompt: str) -> Any:
    """One question over /v1/responses (the SDK's default API); the RunResult."""
    return await _run(endpoint, prompt, OpenAIResponsesModel)
