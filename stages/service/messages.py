"""Anthropic's Messages API on the policy service (`POST /v1/messages`, `POST /v1/messages/count_tokens`).

    client = anthropic.Anthropic(base_url=url, api_key="unused")          # or url + "/ep/{episode_id}"
    client.messages.create(model="base", max_tokens=64, system=..., messages=..., tools=...)

A Messages request is turned into the chat request it means, as the Responses API is
(stages/service/responses.py), so it is sampled, batched, constrained, streamed and recorded exactly
as a chat call is:

| Messages | chat |
| --- | --- |
| `system` (a string or text blocks) | the system message |
| a user message's text blocks / `tool_result` blocks | a user message / one `tool` message per result (`is_error`: its text prefixed `Error: `, the template has no such field) |
| an assistant message's text and `tool_use` blocks | one assistant message with those tool calls (`input` as JSON arguments) |
| `thinking` / `redacted_thinking` blocks sent back | dropped, as Anthropic drops earlier turns' thinking: the policy wrote none (`thinking` is refused) |
| `tools` ({name, description, input_schema}) | function tools |
| `tool_choice` auto / any / tool {name} / none, `disable_parallel_tool_use` | "auto" / "required" / {function: {name}} / "none", `parallel_tool_calls: false` |
| `max_tokens` (required), `stop_sequences`, `temperature`, `top_p` | the same |
| `metadata.user_id` | the episode id when neither the URL nor X-Episode-Id names one |

Other fields follow the field rule of stages/service/schemas.py: `top_k` is refused (only top_p
truncation is implemented), `thinking` unless disabled, `output_config` unless its effort is "high"
(Anthropic's default) and it has no `format`, `container`, `mcp_servers`, `context_management`;
caching and routing hints are ignored. A last assistant message
(a prefill to continue) and content other than text (images, documents, server tools) are refused.

The turn comes back as content blocks: a `text` block when it has text, a `tool_use` block per call
(the service's call id, `input` the parsed arguments; a call whose arguments are not a JSON object
as `{"INVALID_JSON": raw}`), `stop_reason` `tool_use` / `max_tokens` / `stop_sequence` (a requested
stop string ended it, named in `stop_sequence`) / `end_turn`, `usage` input and output tokens. A
client sending that turn back continues the episode as one sequence: its blocks become the tool calls
the service recognises (stages/service/recorder.py).

Streaming is Anthropic's event sequence (`message_start`, per block `content_block_start`,
`content_block_delta` with `text_delta` / `input_json_delta`, `content_block_stop`, then `message_delta`
with stop_reason and output tokens, `message_stop`), each with its `event:` line; text streams as it is
sampled, tool_use blocks come at the end of the turn. Errors on these routes are Anthropic's shape
(`anthropic_error`, used by stages/service/app.py).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from stages.service.schemas import ChatRequest, _Lenient, _Request
from stages.service.served import Caller
from stages.service.service import PolicyService, ServiceError
from tasks.histories import anthropic_messages

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """An error body in Anthropic's shape; a status it has no type for is `invalid_request_error` below
    500 and `api_error` from 500 on."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class TextBlock(_Lenient):  # cache_control, citations: ignored
    type: Literal["text"]
    text: str


class ToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False


class ThinkingBlock(_Lenient):
    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class InputMessage(_Lenient):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        """Name a block type that is not implemented (pydantic would report the union's first branch)."""
        for block in v if isinstance(v, list) else []:
            if isinstance(block, dict) and block.get("type") not in _BLOCK_TYPES:
                raise ValueError(f"a {block.get('type')!r} block is not implemented (the policy takes "
                                 f"{', '.join(_BLOCK_TYPES)})")
        return v


class Tool(_Lenient):  # cache_control: ignored
    type: Literal["custom"] | None = None  # server tools (bash_..., web_search_...) are not implemented
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice {type: tool} needs the tool's name")
        return self


class Metadata(_Lenient):
    user_id: str | None = None  # the episode id when neither the URL nor X-Episode-Id names one


class CountTokensRequest(_Request):
    """POST /v1/messages/count_tokens: what a Messages request's prompt is made of."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    @model_validator(mode="after")
    def _no_prefill(self) -> CountTokensRequest:
        if self.messages[-1].role != "user":
            raise ValueError("messages: the last message must be the user's (continuing an assistant prefill is "
                             "not implemented)")
        return self

    def chat(self, **sampling: Any) -> ChatRequest:
        """The chat request this request means (the module docstring's table)."""
        system = self.system if isinstance(self.system, str) or self.system is None else \
            "".join(b.text for b in self.system)
        messages = ([{"role": "system", "content": system}] if system is not None else []) + \
            [m for message in self.messages for m in anthropic_messages(message.model_dump(exclude_none=True))]
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                   "parameters": t.input_schema}} for t in self.tools or []]
        for t in tools:  # as an OpenAI tool without one: no description at all
            if t["function"]["description"] is None:
                del t["function"]["description"]
        choice, parallel = _tool_choice(self.tool_choice)
        return ChatRequest(model=self.model, messages=messages, tools=tools or None,
                           tool_choice=choice, parallel_tool_calls=parallel, **sampling)


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)  # required, as Anthropic requires it
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    metadata: Metadata | None = None
    stream: bool = False

    def chat(self) -> ChatRequest:
        req = super().chat(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p)
        # Anthropic takes more stop strings than OpenAI's 4, which chat's validator enforces.
        return req.model_copy(update={"stop": list(self.stop_sequences or [])})


def _tool_choice(choice: ToolChoice | None) -> tuple[str | dict[str, Any] | None, bool | None]:
    """Anthropic's tool_choice as chat's (tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    chat = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
        {"type": "function", "function": {"name": choice.name}}
    return chat, False if choice.disable_parallel_tool_use else None


def _content(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice's message as content blocks: its text, then a tool_use block per call."""
    blocks = [{"type": "text", "text": message["content"]}] if message["content"] else []
    for call in message.get("tool_calls", []):
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": _input(call["function"]["arguments"])})
    return blocks


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use `input`, which must be an object: malformed ones wrapped as
    pydantic-ai wraps them (the recorder unwraps the wrapping when the turn comes back)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        value = None
    return value if isinstance(value, dict) else {"INVALID_JSON": arguments}


def _stop(req: MessagesRequest, choice: dict[str, Any]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice."""
    if choice["finish_reason"] == "tool_calls":
        return "tool_use", None
    if choice["finish_reason"] == "length":
        return "max_tokens", None
    hit = choice.get("stop_reason")
    if hit is not None and hit in (req.stop_sequences or []):  # not a stop the rollout stage forced
        return "stop_sequence", hit
    return "end_turn", None


class MessagesAPI:
    """`POST /v1/messages` (plain and streamed) and `/v1/messages/count_tokens` for a policy service."""

    def __init__(self, service: PolicyService) -> None:
        self.service = service

    def count_tokens(self, req: CountTokensRequest, episode_id: str | None) -> dict[str, Any]:
        return {"input_tokens": self.service.prompt_tokens(self._chat(req), episode_id)}

    def _chat(self, req: CountTokensRequest) -> ChatRequest:
        try:
            return req.chat()
        except ValueError as e:  # a block the chat side cannot take (pydantic's ValidationError is one)
            raise ServiceError(400, str(e)) from None

    @staticmethod
    def _message(mid: str, req: MessagesRequest, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                 usage: dict[str, int]) -> dict[str, Any]:
        return {"id": mid, "type": "message", "role": "assistant", "model": req.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    async def create(self, req: MessagesRequest, caller: Caller) -> dict[str, Any]:
        """A plain (non-streamed) message."""
        body = await self.service.chat_completion(self._chat(req), caller)
        (choice,) = body["choices"]
        usage = {"input_tokens": body["usage"]["prompt_tokens"], "output_tokens": body["usage"]["completion_tokens"]}
        return self._message("msg_" + body["id"].removeprefix("chatcmpl-"), req, _content(choice["message"]),
                             _stop(req, choice), usage)

    def stream(self, req: MessagesRequest, caller: Caller) -> AsyncIterator[str]:
        """A streamed message: Anthropic's event sequence (module docstring). A request refused before
        generation raises here, an ordinary HTTP error; a failure during generation ends the stream with
        an `error` event."""
        chat_id, prompt_tokens, events = self.service.chat_deltas(self._chat(req), caller)
        mid = "msg_" + chat_id.removeprefix("chatcmpl-")

        def event(kind: str, **fields: Any) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind} | fields)}\n\n"

        async def run() -> AsyncIterator[str]:
            yield event("message_start", message=self._message(
                mid, req, [], (None, None), {"input_tokens": prompt_tokens, "output_tokens": 0}))
            text_open = False
            async for e in events:
                if e[0] == "error":
                    yield event("error", error=anthropic_error(500, e[1])["error"])
                    return
                delta = e[2] if e[0] == "text" else e[2][0]
                if delta:
                    if not text_open:
                        text_open = True
                        yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
                    yield event("content_block_delta", index=0, delta={"type": "text_delta", "text": delta})
                if e[0] != "end":
                    continue
                _, (choice,), _, usage = e
                if text_open:
                    yield event("content_block_stop", index=0)
                for index, block in enumerate(_content(choice["message"])):
                    if block["type"] == "tool_use":
                        yield event("content_block_start", index=index, content_block=block | {"input": {}})
                        yield event("content_block_delta", index=index,
                                    delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
                        yield event("content_block_stop", index=index)
                reason, sequence = _stop(req, choice)
                yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                            usage={"output_tokens": usage["completion_tokens"]})
                yield event("message_stop")

        return run()
