"""The Responses API (`POST /v1/responses`) through the real `openai` client and the OpenAI Agents SDK's
default `OpenAIResponsesModel`, against the real app on uvicorn over the scripted tiny model: output
items, the streamed event sequence, previous_response_id, and one-segment recording of a tool-using
episode."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import openai
import pytest

from tests.scripted_model import ANSWER, CALL, QUESTION, SYSTEM, TOOL_RESULT, TOOLS
from tests.service_fixtures import client_of

pytestmark = pytest.mark.slow  # the scripted model (built once per run) and a service

FLAT_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]  # the Responses shape


def _episode(served, episode_id: str) -> dict:
    return httpx.get(f"{served.url}/rlops/episodes/{episode_id}").json()


def test_responses_create_with_a_function_call_and_its_echo(served):
    client = client_of(served, "ep-resp")
    first = client.responses.create(model="base", instructions=SYSTEM, input=QUESTION, tools=FLAT_TOOLS,
                                    temperature=0, max_output_tokens=40)
    assert first.status == "completed" and first.id.startswith("resp_")
    (call,) = first.output
    assert call.type == "function_call" and call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.name == CALL["name"] and json.loads(call.arguments) == CALL["arguments"]
    # The Agents SDK's echo: the output item verbatim, then the tool's output.
    second = client.responses.create(
        model="base", instructions=SYSTEM, tools=FLAT_TOOLS, temperature=0, max_output_tokens=40,
        input=[{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}])
    assert second.output_text == ANSWER and second.output[0].type == "message"
    episode = _episode(served, "ep-resp")
    assert episode["segment_starts"] == [] and episode["num_turns"] == 2
    assert sum(episode["loss_mask"]) == first.usage.output_tokens + second.usage.output_tokens

    # pydantic-ai's echo: the item without id and status, arguments re-serialised compactly.
    client = client_of(served, "ep-resp-pai")
    (call,) = client.responses.create(model="base", instructions=SYSTEM, input=QUESTION, tools=FLAT_TOOLS,
                                      temperature=0, max_output_tokens=40).output
    compact = {"type": "function_call", "call_id": call.call_id, "name": call.name,
               "arguments": json.dumps(json.loads(call.arguments), separators=(",", ":"))}
    client.responses.create(model="base", instructions=SYSTEM, tools=FLAT_TOOLS, temperature=0, max_output_tokens=4,
                            input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}, compact,
                                   {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}])
    assert _episode(served, "ep-resp-pai")["segment_starts"] == []


def test_previous_response_id_continues_the_stored_conversation(served):
    client = client_of(served, "ep-prev")
    first = client.responses.create(model="base", instructions=SYSTEM, input=QUESTION, tools=FLAT_TOOLS,
                                    temperature=0, max_output_tokens=40)
    (call,) = first.output
    second = client.responses.create(
        model="base", instructions=SYSTEM, tools=FLAT_TOOLS, temperature=0, max_output_tokens=40,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}])
    assert second.output_text == ANSWER
    assert _episode(served, "ep-prev")["segment_starts"] == []
    with pytest.raises(openai.NotFoundError, match="resp_nope"):
        client.responses.create(model="base", input="hi", previous_response_id="resp_nope")
    with pytest.raises(openai.BadRequestError, match="n: "):
        client.responses.create(model="base", input="hi", extra_body={"n": 2})


def test_responses_stream_helper_parses_the_events_and_text_adds_up(served):
    client = client_of(served, "ep-resp-stream")
    with client.responses.stream(model="base", instructions=SYSTEM, input=QUESTION, tools=FLAT_TOOLS,
                                 temperature=0, max_output_tokens=40) as stream:
        kinds = [e.type for e in stream]
        first = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    (call,) = first.output
    assert call.type == "function_call" and json.loads(call.arguments) == CALL["arguments"]
    with client.responses.stream(
            model="base", instructions=SYSTEM, tools=FLAT_TOOLS, temperature=0, max_output_tokens=40,
            input=[{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True),
                   {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}]) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        second = stream.get_final_response()
    assert "".join(deltas) == second.output_text == ANSWER
    assert _episode(served, "ep-resp-stream")["segment_starts"] == []


@pytest.mark.parametrize("streamed", [False, True])
def test_the_agents_sdk_default_responses_model_runs_a_tool_using_episode(served, streamed, monkeypatch):
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # it would otherwise send traces to api.openai.com
    episode_id = f"ep-sdk-{streamed}"

    @function_tool
    def search(query: str) -> str:
        """Search the knowledge base."""
        return TOOL_RESULT

    async def run():
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0,
                                    default_headers={"X-Episode-Id": episode_id})
        agent = Agent(name="searcher", instructions=SYSTEM, tools=[search],
                      model=OpenAIResponsesModel("base", openai_client=client),
                      model_settings=ModelSettings(temperature=0, max_tokens=40))
        try:
            if not streamed:
                return await Runner.run(agent, QUESTION)
            result = Runner.run_streamed(agent, QUESTION)
            async for _ in result.stream_events():
                pass
            return result
        finally:
            await client.close()

    result = asyncio.run(run())
    assert result.final_output == ANSWER
    episode = _episode(served, episode_id)
    assert episode["segment_starts"] == [] and episode["num_turns"] == 2
    assert sum(episode["loss_mask"]) == sum(r.usage.output_tokens for r in result.raw_responses)
    assert os.environ["OPENAI_AGENTS_DISABLE_TRACING"] == "1"


def test_a_failure_during_a_streamed_response_ends_it_with_error_events(scripted_policy):
    from tests.service_fixtures import broken_service

    with broken_service(scripted_policy) as url:  # fails inside generation
        with httpx.stream("POST", f"{url}/v1/responses", json={"model": "broken", "input": "hi", "stream": True},
                          timeout=120) as r:
            kinds = [json.loads(line[6:])["type"] for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200 and kinds[0] == "response.created" and kinds[-2:] == ["error", "response.failed"]
        r = httpx.post(f"{url}/v1/responses", json={"model": "nope", "input": "hi", "stream": True}, timeout=60)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"  # refused before streaming
