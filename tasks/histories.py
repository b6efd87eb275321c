"""A framework's own conversation history, as the OpenAI chat messages a rollout stores.

An external agent (tasks/agent.py) may return its conversation in its framework's types; each is
recognised by the module of its type, and no framework is ever imported here (their objects carry
what is needed):

    LangChain / LangGraph   BaseMessage (HumanMessage, AIMessage with tool_calls, ToolMessage, ...)
                            -> langchain_core.messages.convert_to_openai_messages
    OpenAI Agents SDK       a RunResult (its `to_input_list()`), or those Responses input items
    Responses input items   {"role", "content"} / {"type": "message"}, "function_call", "function_call_output"
    pydantic-ai             an AgentRunResult (its `all_messages()`), ModelRequest / ModelResponse
    smolagents              an agent (its memory), memory steps (TaskStep, ActionStep, ...), or the
                            ChatMessages of `agent.write_memory_to_messages()`
    openai / LiteLLM        message objects with `model_dump` (ChatCompletionMessage, litellm Message)
    Anthropic Messages API  {"role", "content": [blocks]} with text / tool_use / tool_result / thinking
                            blocks, dicts or the `anthropic` SDK's objects (`anthropic_messages`)

`to_chat_messages` returns OpenAI chat dicts (still to be validated by the service's schema) and
raises `Unconvertible` with the reason for anything it cannot read; the rollout stage then keeps the
recorded conversation and notes why (metadata["messages_note"]).
"""

from __future__ import annotations

import json
from typing import Any

FRAMEWORKS = ("langchain_core", "langchain", "langgraph", "agents", "pydantic_ai", "smolagents", "litellm", "anthropic")


class Unconvertible(ValueError):
    """A returned history this module cannot read (the reason is the message)."""


def framework_of(value: Any) -> str | None:
    """The framework a value's type comes from (the top module of its type), None for plain data."""
    top = type(value).__module__.split(".")[0]
    return top if top in FRAMEWORKS else None


def is_framework_history(value: Any) -> bool:
    """Whether a returned `messages` value (or a returned object) is in a framework's own types."""
    if isinstance(value, list):
        return any(framework_of(m) or _is_responses_item(m) or _is_anthropic_message(m) for m in value)
    return framework_of(value) is not None


def to_chat_messages(value: Any) -> list[dict[str, Any]]:
    """`value` (a list of messages in any of the module docstring's forms, mixed or not, or one framework
    result object) as OpenAI chat message dicts."""
    if not isinstance(value, list):
        value = _unwrap(value)
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant turn Responses items are adding to
    for item in value:
        kind = framework_of(item)
        if isinstance(item, dict) and _is_responses_item(item):
            turn = _add_responses_item(out, item, turn)
            continue
        turn = None
        if _is_anthropic_message(item):
            out += anthropic_messages(item)
        elif isinstance(item, dict):
            out.append(item)
        elif kind in ("langchain_core", "langchain", "langgraph"):
            from langchain_core.messages import convert_to_openai_messages  # the message's own package: installed

            out.append(convert_to_openai_messages(item))
        elif kind == "pydantic_ai" and getattr(item, "kind", None) in ("request", "response"):
            out += _pydantic_ai(item, first=not out)
        elif kind == "smolagents":
            out += _smolagents_step(item)
        elif hasattr(item, "model_dump"):  # openai's and LiteLLM's message objects
            out.append(item.model_dump(exclude_none=True))
        else:
            raise Unconvertible(f"a {type(item).__module__}.{type(item).__name__} in the returned messages")
    return out


def _unwrap(value: Any) -> list[Any]:
    """The message list a framework result object holds."""
    kind = framework_of(value)
    if kind == "agents" and hasattr(value, "to_input_list"):
        return value.to_input_list()  # a RunResult: Responses input items (the instructions are not in it)
    if kind == "pydantic_ai" and hasattr(value, "all_messages"):
        return value.all_messages()
    if kind == "smolagents" and hasattr(value, "memory"):
        system = getattr(value.memory, "system_prompt", None)
        return ([system] if system is not None else []) + list(value.memory.steps)
    raise Unconvertible(f"a {type(value).__module__}.{type(value).__name__} is not a conversation this rollout can read")


# -- Responses input items (the OpenAI Agents SDK's history, any Responses API client's) ----------

_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _is_responses_item(item: Any) -> bool:
    return isinstance(item, dict) and (item.get("type") in _ITEM_TYPES or
                                       ("role" in item and isinstance(item.get("content"), list)
                                        and any(isinstance(p, dict) and p.get("type") in
                                                ("input_text", "output_text") for p in item["content"])))


def _text(content: Any) -> str | None:
    """Text of a content that is a string or a list of text parts (input_text / output_text / text)."""
    if content is None or isinstance(content, str):
        return content
    parts = []
    for p in content:
        if isinstance(p, str):
            parts.append(p)
        elif isinstance(p, dict) and isinstance(p.get("text"), str):
            parts.append(p["text"])
        elif isinstance(p, dict) and p.get("type") == "refusal":
            parts.append(p.get("refusal", ""))
        else:
            raise Unconvertible(f"a content part that is not text: {str(p)[:200]}")
    return "".join(parts)


def _add_responses_item(out: list[dict[str, Any]], item: dict[str, Any],
                        turn: dict[str, Any] | None) -> dict[str, Any] | None:
    """Append one Responses item to `out`; returns the assistant turn later function calls join (the
    calls of one model turn follow its message item, if any: one assistant chat message)."""
    kind = item.get("type", "message")
    if kind == "reasoning":
        return turn  # not text the policy is given back as a turn
    if kind == "function_call":
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments", "")}}
        if turn is None:
            turn = {"role": "assistant", "content": None}
            out.append(turn)
        turn.setdefault("tool_calls", []).append(call)
        return turn
    if kind == "function_call_output":
        out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"))})
        return None
    out.append({"role": item["role"], "content": _text(item.get("content"))})
    return out[-1] if item["role"] == "assistant" else None


# -- Anthropic's Messages API (the anthropic SDK's history, any Messages API client's) ----------------

_ANTHROPIC_BLOCKS = ("tool_use", "tool_result", "thinking", "redacted_thinking")


def _is_anthropic_message(item: Any) -> bool:
    content = item.get("content") if isinstance(item, dict) else None
    return isinstance(content, list) and any(
        framework_of(b) == "anthropic" or (isinstance(b, dict) and b.get("type") in _ANTHROPIC_BLOCKS) for b in content)


def anthropic_messages(message: dict[str, Any]) -> list[dict[str, Any]]:
    """One Messages-API message as chat messages. An assistant message is one message: its text blocks
    joined, a tool call per `tool_use` block (`input` as JSON arguments), its `thinking` /
    `redacted_thinking` blocks dropped (as Anthropic drops earlier turns' thinking). A user message is
    a `tool` message per `tool_result` block (`is_error`: the text prefixed `Error: `, chat has no such
    field) and a user message per run of text blocks, in order. Also the policy service's translation
    of a Messages request (stages/service/messages.py)."""
    content = message["content"]
    if isinstance(content, str):
        return [{"role": message["role"], "content": content}]
    blocks = [b.model_dump() if framework_of(b) == "anthropic" else b for b in content]
    if message["role"] == "assistant":
        calls = [{"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": json.dumps(b["input"])}}
                 for b in blocks if b.get("type") == "tool_use"]
        if stray := [b.get("type") for b in blocks if b.get("type") not in ("text", "tool_use", "thinking",
                                                                            "redacted_thinking")]:
            raise Unconvertible(f"an assistant message holds a {stray[0]!r} block")
        text = "".join(b["text"] for b in blocks if b.get("type") == "text")
        return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]
    out: list[dict[str, Any]] = []
    for b in blocks:
        if b.get("type") == "tool_result":
            text = _text(b.get("content")) or ""
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                        "content": f"Error: {text}" if b.get("is_error") else text})
        elif b.get("type") == "text" and out and out[-1]["role"] == "user":
            out[-1]["content"] += b["text"]
        elif b.get("type") == "text":
            out.append({"role": "user", "content": b["text"]})
        else:
            raise Unconvertible(f"a user message holds a {b.get('type')!r} block")
    return out


# -- pydantic-ai -------------------------------------------------------------------------------------

def _pydantic_ai(message: Any, first: bool) -> list[dict[str, Any]]:
    """One ModelRequest (system/user prompts, tool returns, retry prompts) or ModelResponse (text +
    tool calls, arguments as the model wrote them) as chat messages."""
    if message.kind == "response":
        text = "".join(p.content for p in message.parts if p.part_kind == "text")
        calls = [{"id": p.tool_call_id, "type": "function",
                  "function": {"name": p.tool_name, "arguments": p.args if isinstance(p.args, str) else p.args_as_json_str()}}
                 for p in message.parts if p.part_kind == "tool-call"]
        return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]
    out = [{"role": "system", "content": message.instructions}] if first and getattr(message, "instructions", None) else []
    for p in message.parts:
        if p.part_kind == "system-prompt":
            out.append({"role": "system", "content": p.content})
        elif p.part_kind == "user-prompt":
            out.append({"role": "user", "content": p.content if isinstance(p.content, str) else _text(p.content)})
        elif p.part_kind == "tool-return":
            out.append({"role": "tool", "tool_call_id": p.tool_call_id, "content": p.model_response_str()})
        elif p.part_kind == "retry-prompt":
            out.append({"role": "tool", "tool_call_id": p.tool_call_id, "content": p.model_response()} if p.tool_name
                       else {"role": "user", "content": p.model_response()})
        else:
            raise Unconvertible(f"a pydantic-ai {p.part_kind!r} part")
    return out


# -- smolagents ----------------------------------------------------------------------------------------

def _smolagents_step(step: Any) -> list[dict[str, Any]]:
    """A memory step as structured chat messages (smolagents itself sends tool calls to the model as
    "Calling tools: [...]" text; this is what the model's turns meant), or one ChatMessage of
    `write_memory_to_messages()` (roles tool-call / tool-response are sent as assistant / user)."""
    name = type(step).__name__
    if name == "SystemPromptStep":
        return [{"role": "system", "content": step.system_prompt}]
    if name == "TaskStep":
        return [{"role": "user", "content": step.task}]
    if name in ("PlanningStep", "FinalAnswerStep"):
        return []  # neither is a model turn of its own in the conversation (a plan's call is in the recording)
    if name == "ChatMessage":
        role = getattr(step.role, "value", step.role)
        return [{"role": {"tool-call": "assistant", "tool-response": "user"}.get(role, role), "content": _text(step.content)}]
    if name != "ActionStep":
        raise Unconvertible(f"a smolagents {name}")
    if step.model_output_message is None:
        return []
    msg = step.model_output_message
    raw_calls = {}  # the arguments as the model wrote them, when the (non-streamed) response is kept
    if getattr(msg, "raw", None) is not None and getattr(msg.raw, "choices", None):
        raw_calls = {c.id: c.function.arguments for c in msg.raw.choices[0].message.tool_calls or []}
    calls = [{"id": c.id, "type": "function",
              "function": {"name": c.name, "arguments": raw_calls.get(c.id) or
                           (c.arguments if isinstance(c.arguments, str) else json.dumps(c.arguments))}}
             for c in step.tool_calls or []]
    if step.is_final_answer and all(c["function"]["name"] == "final_answer" for c in calls):
        # smolagents answers by calling its final_answer tool; stored as the answer it is, so rewards
        # read it as any agent's last message (the tokens hold the call as sampled).
        return [{"role": "assistant", "content": str(step.action_output)}]
    out = [{"role": "assistant", "content": _text(msg.content) or None, **({"tool_calls": calls} if calls else {})}]
    if calls and not step.is_final_answer:
        # smolagents keeps one observation text for all the step's calls: it answers the first call.
        out += [{"role": "tool", "tool_call_id": c["id"], "content": (step.observations or "") if i == 0 else ""}
                for i, c in enumerate(calls)]
    return out
