"""Real agent frameworks against the real policy service on uvicorn: LangGraph + langchain-openai, the
OpenAI Agents SDK (chat completions and Responses models) and pydantic-ai, each configured as its docs
show (a base_url, or an openai client object; any api_key), each running the scripted doc_search-like
episode (the question, a `search` tool returning the scripted result, the answer) plainly and streamed.

The model is the scripted tiny model (tests/scripted_model.py): every framework here is given the
scripted system prompt and a `search(query)` tool described as "Search the knowledge base.", and the
service renders tools into the system message from their name, parameter names and description only
(tasks/base.py render_system_prompt), so each framework's request is the prompt the model memorised:
the tool call and the answer are really generated through the service, whatever else the framework
adds to the request (strict schemas, titles, tool_choice "auto", stream options).

Each episode is asserted (tests/stages/service/framework_checks.py): one segment, the loss mask summing
to the completion tokens the server reported in `usage` (read from the framework's own usage object),
the sampled tokens being the call and the answer; the streamed run records what the plain one did."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest

from tests.scripted_model import ANSWER, QUESTION, SYSTEM, TOOL_RESULT
from tests.stages.service.framework_checks import check_tool_episode, same_record

pytestmark = pytest.mark.slow  # the scripted model (built once per run); framework imports take ~10 s


def _watched() -> tuple[httpx.AsyncClient, list[dict[str, Any]]]:
    """An httpx client for a framework's openai client, keeping each request's JSON body (to see that a
    streamed run really asked for a stream)."""
    bodies: list[dict[str, Any]] = []

    async def keep(request: httpx.Request) -> None:
        bodies.append(json.loads(request.content))

    return httpx.AsyncClient(timeout=120, event_hooks={"request": [keep]}), bodies


def test_langgraph_react_agent_ainvoke_and_astream(served):
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def search(query: str) -> str:
        """Search the knowledge base."""
        return TOOL_RESULT

    async def run(episode_id: str, streamed: bool) -> tuple[dict, list[dict]]:
        http, bodies = _watched()
        # The documented way: base_url (here with the episode in it), any api_key. With a custom base_url
        # langchain-openai asks for no usage on a stream unless stream_usage=True.
        llm = ChatOpenAI(model="base", base_url=f"{served.url}/ep/{episode_id}/v1", api_key="unused",
                         temperature=0, max_retries=0, stream_usage=True, http_async_client=http)
        agent = create_agent(llm, [search], system_prompt=SYSTEM)
        question = {"messages": [{"role": "user", "content": QUESTION}]}
        try:
            if not streamed:
                return await agent.ainvoke(question), bodies
            state = None
            # stream_mode "messages" makes the chat model stream token chunks; "values" gives the final state.
            async for mode, data in agent.astream(question, stream_mode=["messages", "values"]):
                if mode == "values":
                    state = data
            return state, bodies
        finally:
            await http.aclose()

    records = {}
    for streamed in (False, True):
        state, bodies = asyncio.run(run(f"ep-lg-{streamed}", streamed))
        assert [b.get("stream") for b in bodies] == [streamed, streamed]
        ai = [m for m in state["messages"] if isinstance(m, AIMessage)]
        assert [c["name"] for c in ai[0].tool_calls] == ["search"] and ai[-1].content == ANSWER
        records[streamed] = check_tool_episode(served, f"ep-lg-{streamed}",
                                               sum(m.usage_metadata["output_tokens"] for m in ai))
    same_record(records[False], records[True])


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_agents_sdk_run_and_run_streamed(served, api, monkeypatch):
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool,
                        set_tracing_disabled)

    set_tracing_disabled(True)  # it would otherwise send traces to api.openai.com when a key is set

    @function_tool
    def search(query: str) -> str:
        """Search the knowledge base."""
        return TOOL_RESULT

    async def run(episode_id: str, streamed: bool) -> tuple[Any, list[dict]]:
        http, bodies = _watched()
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, http_client=http,
                                    default_headers={"X-Episode-Id": episode_id})
        model_class = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
        # include_usage: a streamed chat call reports usage only when asked (the SDK does not ask by default).
        agent = Agent(name="searcher", instructions=SYSTEM, tools=[search],
                      model=model_class(model="base", openai_client=client),
                      model_settings=ModelSettings(temperature=0, max_tokens=40, include_usage=True))
        try:
            if not streamed:
                return await Runner.run(agent, QUESTION), bodies
            result = Runner.run_streamed(agent, QUESTION)
            async for _ in result.stream_events():
                pass
            return result, bodies
        finally:
            await client.close()

    records = {}
    for streamed in (False, True):
        episode_id = f"ep-sdk-{api}-{streamed}"
        result, bodies = asyncio.run(run(episode_id, streamed))
        assert [bool(b.get("stream")) for b in bodies] == [streamed, streamed]
        assert result.final_output == ANSWER
        records[streamed] = check_tool_episode(served, episode_id,
                                               sum(r.usage.output_tokens for r in result.raw_responses))
    same_record(records[False], records[True])


def test_pydantic_ai_run_and_run_stream(served):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    def search(query: str) -> str:
        """Search the knowledge base."""
        return TOOL_RESULT

    async def run(episode_id: str, streamed: bool) -> tuple[str, int, list[dict]]:
        http, bodies = _watched()
        client = openai.AsyncOpenAI(base_url=f"{served.url}/ep/{episode_id}/v1", api_key="unused", max_retries=0,
                                    http_client=http)
        provider = OpenAIProvider(openai_client=client)
        agent = Agent(OpenAIChatModel("base", provider=provider), instructions=SYSTEM, tools=[search],
                      model_settings={"temperature": 0, "max_tokens": 40})
        try:
            if not streamed:
                result = await agent.run(QUESTION)
                return result.output, result.usage.output_tokens, bodies
            async with agent.run_stream(QUESTION) as result:
                async for _ in result.stream_output():
                    pass
                return await result.get_output(), result.usage.output_tokens, bodies
        finally:
            await http.aclose()

    records = {}
    for streamed in (False, True):
        episode_id = f"ep-pai-{streamed}"
        output, output_tokens, bodies = asyncio.run(run(episode_id, streamed))
        assert [bool(b.get("stream")) for b in bodies] == [streamed, streamed]
        assert all(b["tool_choice"] == "auto" for b in bodies)  # pydantic-ai always sends it with tools
        assert output == ANSWER
        records[streamed] = check_tool_episode(served, episode_id, output_tokens)
    same_record(records[False], records[True])
