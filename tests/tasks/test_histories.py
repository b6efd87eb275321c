"""A framework's own history (real LangChain, Agents SDK, pydantic-ai and smolagents objects, built
without a model) converted into the OpenAI chat messages a rollout stores (tasks/histories.py)."""

from __future__ import annotations

import json

import pytest

from stages.service.schemas import ChatMessage
from tasks.histories import Unconvertible, is_framework_history, to_chat_messages

# The doc_search exchange every framework's history below holds: ask, search, the result, answer.
ARGS = '{"query": "Grougo Ninael"}'
RESULT = "doc-001: Grougo Ninael was born in Fograndford."


def _check(messages: list[dict], roles: list[str], system: str | None = None) -> None:
    """Roles in order; the search call with its id and JSON arguments; the tool result answering that id;
    every message valid for the service's schema (what the rollout stage stores)."""
    assert [m["role"] for m in messages] == roles
    call = next(m for m in messages if m.get("tool_calls"))["tool_calls"][0]
    assert call["id"] == "call_1" and call["function"]["name"] == "search"
    assert json.loads(call["function"]["arguments"]) == {"query": "Grougo Ninael"}
    tool = next(m for m in messages if m["role"] == "tool")
    assert tool["tool_call_id"] == "call_1" and tool["content"] == RESULT
    assert messages[-1]["content"] == "Fograndford"
    if system is not None:
        assert messages[0] == {"role": "system", "content": system}
    stored = [ChatMessage.model_validate(m).to_message() for m in messages]
    assert stored[roles.index("assistant")].tool_calls[0].arguments == call["function"]["arguments"]


def test_langchain_messages():
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    history = [HumanMessage("Where was Grougo Ninael born?"),
               AIMessage("", tool_calls=[{"name": "search", "args": json.loads(ARGS), "id": "call_1"}]),
               ToolMessage(RESULT, tool_call_id="call_1", name="search"), AIMessage("Fograndford")]
    assert is_framework_history(history)
    _check(to_chat_messages(history), ["user", "assistant", "tool", "assistant"])


def _sdk_items() -> list:
    from agents import Agent
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
    from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText

    agent = Agent(name="doc_search", instructions="Answer from the documents.")
    call = ResponseFunctionToolCall(type="function_call", call_id="call_1", name="search", arguments=ARGS, id="fc_1",
                                    status="completed")
    output = {"type": "function_call_output", "call_id": "call_1", "output": RESULT}
    answer = ResponseOutputMessage(id="msg_1", type="message", role="assistant", status="completed",
                                   content=[ResponseOutputText(type="output_text", text="Fograndford", annotations=[])])
    return agent, [ToolCallItem(agent=agent, raw_item=call), ToolCallOutputItem(agent=agent, raw_item=output, output=RESULT),
                   MessageOutputItem(agent=agent, raw_item=answer)]


def test_agents_sdk_run_result_and_its_input_items():
    from agents import RunContextWrapper
    from agents.result import RunResult

    agent, items = _sdk_items()
    result = RunResult(input="Where was Grougo Ninael born?", new_items=items, raw_responses=[], final_output="Fograndford",
                       input_guardrail_results=[], output_guardrail_results=[], tool_input_guardrail_results=[],
                       tool_output_guardrail_results=[], context_wrapper=RunContextWrapper(None), _last_agent=agent)
    assert is_framework_history(result)
    _check(to_chat_messages(result), ["user", "assistant", "tool", "assistant"])
    _check(to_chat_messages(result.to_input_list()), ["user", "assistant", "tool", "assistant"])


def test_responses_items_join_a_turns_text_and_calls():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Where?"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Searching."}]},
             {"type": "function_call", "call_id": "call_1", "name": "search", "arguments": ARGS},
             {"type": "reasoning", "summary": []},
             {"type": "function_call_output", "call_id": "call_1", "output": RESULT},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Fograndford"}]}]
    out = to_chat_messages(items)
    _check(out, ["user", "assistant", "tool", "assistant"])
    assert out[0]["content"] == "Where?" and out[1]["content"] == "Searching."


def test_pydantic_ai_messages_and_run_result():
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import FunctionModel

    def model(messages, info):  # a real pydantic-ai model: search once, then answer
        if len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart("search", ARGS, tool_call_id="call_1")])
        return ModelResponse(parts=[TextPart("Fograndford")])

    agent = Agent(FunctionModel(model), instructions="Answer from the documents.")

    @agent.tool_plain
    def search(query: str) -> str:
        return RESULT

    result = agent.run_sync("Where was Grougo Ninael born?")
    _check(to_chat_messages(result), ["system", "user", "assistant", "tool", "assistant"], "Answer from the documents.")
    _check(to_chat_messages(result.all_messages()), ["system", "user", "assistant", "tool", "assistant"])


def _smolagents_steps() -> list:
    from smolagents.memory import ActionStep, SystemPromptStep, TaskStep, ToolCall
    from smolagents.models import ChatMessage as SmolMessage, ChatMessageToolCall, ChatMessageToolCallFunction, MessageRole
    from smolagents.monitoring import Timing

    def step(n: int, name: str, arguments: dict, observations: str | None, output: str | None) -> ActionStep:
        wire = ChatMessageToolCall(function=ChatMessageToolCallFunction(name=name, arguments=arguments), id=f"call_{n}",
                                   type="function")
        return ActionStep(step_number=n, timing=Timing(0.0), tool_calls=[ToolCall(name, arguments, f"call_{n}")],
                          model_output_message=SmolMessage(MessageRole.ASSISTANT, "", tool_calls=[wire]),
                          observations=observations, action_output=output, is_final_answer=output is not None)

    return [SystemPromptStep("You are an agent."), TaskStep("Where was Grougo Ninael born?"),
            step(1, "search", json.loads(ARGS), RESULT, None),
            step(2, "final_answer", {"answer": "Fograndford"}, None, "Fograndford")]


def test_smolagents_memory_steps():
    steps = _smolagents_steps()
    # smolagents' final_answer call is stored as the answer it gives.
    _check(to_chat_messages(steps), ["system", "user", "assistant", "tool", "assistant"], "You are an agent.")


def test_unreadable_histories_say_what_they_hold():
    with pytest.raises(Unconvertible, match="builtins.object in the returned messages"):
        to_chat_messages([{"role": "user", "content": "q"}, object()])
    with pytest.raises(Unconvertible, match="a content part that is not text"):
        to_chat_messages([{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])
    assert not is_framework_history([{"role": "user", "content": "q"}])


def test_anthropic_messages_with_the_sdks_blocks():
    from anthropic.types import TextBlock, ThinkingBlock, ToolUseBlock

    history = [{"role": "user", "content": "Where was Grougo Ninael born?"},
               {"role": "assistant", "content": [ThinkingBlock(type="thinking", thinking="search first", signature="s"),
                                                 ToolUseBlock(type="tool_use", id="call_1", name="search",
                                                              input=json.loads(ARGS))]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                             "content": [{"type": "text", "text": RESULT}]}]},
               {"role": "assistant", "content": [TextBlock(type="text", text="Fograndford")]}]
    assert is_framework_history(history)
    messages = to_chat_messages(history)
    _check(messages, ["user", "assistant", "tool", "assistant"])
    assert messages[1]["content"] is None  # the thinking block is dropped: the policy wrote none


def test_anthropic_tool_errors_and_text_after_results():
    turn = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "no such doc",
                                         "is_error": True},
                                        {"type": "tool_result", "tool_use_id": "t2", "content": RESULT},
                                        {"type": "text", "text": "Answer "}, {"type": "text", "text": "briefly."}]}
    assert to_chat_messages([turn]) == [{"role": "tool", "tool_call_id": "t1", "content": "Error: no such doc"},
                                        {"role": "tool", "tool_call_id": "t2", "content": RESULT},
                                        {"role": "user", "content": "Answer briefly."}]
    with pytest.raises(Unconvertible, match="image"):
        to_chat_messages([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"},
                                                       {"type": "image", "source": {}}]}])
