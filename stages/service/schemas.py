"""The OpenAI request and response shapes of the policy service, and their conversions.

Requests are validated with pydantic: a malformed one (a missing field, a wrong type, an unknown
role, ...) is a 400 with an OpenAI-style error body, built in stages/service/app.py.

The field rule, for a request's top-level fields: a field is honoured (declared on the request
model below), or accepted and ignored because it does not change what is sampled or returned
(`IGNORED`, some only at their harmless values), or refused with a 400 that names it, never a
silent no-op: the fields listed in `REFUSED` with the reason, and any other unknown field. A field
sent as `null` means "not set" and is always accepted. Nested objects (messages, tool calls) keep
ignoring extra keys (`annotations`, `refusal`, `index`): clients echo them back. `tool_choice`,
`parallel_tool_calls`, `response_format` and `top_logprobs` are honoured or refused by
stages/service/decoding.py.

Content parts: `text` and `image_url` in chat messages (not in an assistant's), `input_text`,
`output_text` and `input_image` in Responses items. Whether images are taken is the policy's
business: the service refuses them for a text-only policy and stores them for a vision-language
one (`ChatRequest.conversation(mark)`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stages.policy.sampling import Sample
from storage.schema import Message, ToolCall
from tasks.base import OPEN_TAG, TOOL_CALL_RE, render_system_prompt


def _always(_: Any) -> bool:
    return True


# Accepted and ignored: bookkeeping, caching and routing hints, and settings at the values that are
# what rlops does anyway. Each maps to the test of a harmless value; any other value is refused.
IGNORED: dict[str, Callable[[Any], bool]] = {
    "store": _always, "metadata": _always, "service_tier": _always, "prompt_cache_key": _always,
    "prompt_cache_retention": _always, "safety_identifier": _always, "user": _always,
    "parallel_tool_calls": lambda v: v is True,  # the model may write several calls in a turn
    "include": lambda v: v == [],  # extra output (e.g. logprobs in Responses) is not produced
    "presence_penalty": lambda v: v == 0, "frequency_penalty": lambda v: v == 0,
    "logit_bias": lambda v: not v, "modalities": lambda v: v == ["text"],
    "echo": lambda v: v is False, "best_of": lambda v: v == 1,
    "truncation": lambda v: v == "disabled",  # a prompt over the context is a 400, never truncated
    "text": lambda v: isinstance(v, dict) and v.get("format", {"type": "text"}) == {"type": "text"},
    # Anthropic's Messages API (stages/service/messages.py): caching, routing and account hints.
    "cache_control": _always, "diagnostics": _always, "inference_geo": _always, "speed": _always,
    "user_profile_id": _always, "workspace_id": _always,
    "thinking": lambda v: isinstance(v, dict) and v.get("type") == "disabled",
    # Effort "high" is Anthropic's default: the same as omitting it. Other efforts and `format` are refused.
    "output_config": lambda v: isinstance(v, dict) and v.get("format") is None and v.get("effort") in (None, "high")
    and set(v) <= {"format", "effort"},
}
# Refused with the reason: they would change what is sampled or returned and are not implemented.
REFUSED: dict[str, str] = {
    "logit_bias": "biasing logits would make the recorded log-probs differ from the policy's",
    "presence_penalty": "penalties would make the recorded log-probs differ from the policy's",
    "frequency_penalty": "penalties would make the recorded log-probs differ from the policy's",
    "repetition_penalty": "penalties would make the recorded log-probs differ from the policy's",
    "top_k": "only top_p truncation is implemented", "min_p": "only top_p truncation is implemented",
    "audio": "only text is generated", "modalities": "only text is generated",
    "prediction": "predicted outputs are not implemented",
    "functions": "the legacy `functions` field is not implemented: use `tools`",
    "function_call": "the legacy `function_call` field is not implemented: use `tools`",
    "reasoning": "reasoning settings are not implemented", "reasoning_effort": "reasoning settings are not implemented",
    "parallel_tool_calls": "only parallel_tool_calls: true (the default) is implemented",
    "include": "no extra output is implemented: include must be []",
    "n": "the Responses API has no n: send n requests", "echo": "echo is not implemented",
    "best_of": "best_of is not implemented", "suffix": "suffix is not implemented",
    "web_search_options": "no built-in tools", "background": "background responses are not implemented",
    "truncation": "a prompt over the context is refused, never truncated: truncation must be \"disabled\"",
    "text": "only plain text output is implemented (structured output: use chat's response_format)",
    "tool_choice": "tool_choice applies to chat and Responses requests with tools",
    "response_format": "response_format applies to chat requests",
    "max_tool_calls": "max_tool_calls is not implemented",
    "conversation": "stored conversations: use previous_response_id",
    "thinking": "extended thinking is not implemented: send {\"type\": \"disabled\"} or omit it",
    "output_config": "only effort \"high\" (the default) is implemented; structured output (format) is not",
    "container": "code-execution containers are not implemented",
    "mcp_servers": "remote MCP servers are not implemented: run the tools in the agent",
    "context_management": "server-side context editing is not implemented",
}


class UnsupportedField(ValueError):
    """A request field the service refuses (the field rule above)."""

    def __init__(self, field: str) -> None:
        reason = REFUSED.get(field, "unknown field: the policy service refuses what it does not implement")
        super().__init__(f"{field}: {reason}")
        self.field = field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionCall(_Lenient):
    name: str
    arguments: str


class ToolCallIn(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ImageURL(_Lenient):  # detail: ignored (the processor's own image settings decide the pixels)
    url: str  # a base64 data URL, or a local file under the service's image root (ServiceConfig.image_root)


class ImagePart(_Lenient):
    type: Literal["image_url"]
    image_url: ImageURL


# Turns a message content (text or parts) into a record's content, images stored and referenced (a
# vision-language policy's service: stages.policy.vlm_chat.marked_content); ValueError for a bad image.
ContentMarker = Callable[[str | list[dict[str, Any]] | None], str | None]


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _no_assistant_images(self) -> ChatMessage:
        if self.role == "assistant" and self.has_images():
            raise ValueError("an assistant message cannot hold image_url parts (the model writes text)")
        return self

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(p.type == "image_url" for p in self.content)

    def image_count(self) -> int:
        return sum(p.type == "image_url" for p in self.content) if isinstance(self.content, list) else 0

    def to_message(self, mark: ContentMarker | None = None) -> Message:
        """The message as a record; a content with images through `mark` (ValueError without one: only a
        vision-language policy can take images, and the service checks that first, naming the message)."""
        if mark is not None and self.role != "assistant":  # a text may not pass for an image reference either
            content = mark([p.model_dump() for p in self.content] if isinstance(self.content, list) else self.content)
        elif self.has_images():
            raise ValueError("image_url content parts need a vision-language policy")
        else:
            content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        calls = [ToolCall(c.id, c.function.name, c.function.arguments) for c in self.tool_calls or []]
        role = "system" if self.role == "developer" else self.role  # chat templates know "system"
        return Message(role, content, calls, self.tool_call_id, self.name)


class StreamOptions(_Lenient):
    include_usage: bool = False  # a last chunk with `usage` and no choices


class _Request(_Lenient):
    """A request body, with the field rule applied to its top-level fields."""

    @model_validator(mode="before")
    @classmethod
    def _field_rule(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, value in data.items():
                if name in cls.model_fields or value is None:
                    continue
                harmless = IGNORED.get(name)
                if harmless is None or not harmless(value):
                    raise UnsupportedField(name)
        return data


class _Sampling(_Request):
    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = Field(None, validate_default=True)
    n: int = Field(1, ge=1, le=64)
    seed: int | None = None
    user: str | None = None  # the episode id when no X-Episode-Id header is sent
    stream: bool = False  # Server-Sent Events (stages/service/stream.py)
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None  # OpenAI function schemas
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool = False
    # The k most likely tokens at each step, from the distribution the token was drawn from (needs logprobs: true).
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Constrained decoding (stages/service/decoding.py): each value is honoured or refused, never ignored.
    tool_choice: str | dict[str, Any] | None = None  # auto | none | required | {type: function, function: {name}}
    parallel_tool_calls: bool | None = None  # false: at most one call in a constrained turn
    response_format: dict[str, Any] | None = None  # {type: text | json_object | json_schema, json_schema: {schema}}
    metadata: dict[str, Any] | None = None  # the client's tags: kept with the call by `rlops serve` (stages/service/served.py)

    @field_validator("tools")
    @classmethod
    def _functions(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for spec in v or []:
            if spec.get("type") != "function" or not isinstance(spec.get("function"), dict) \
                    or not spec["function"].get("name"):
                raise ValueError("each tool must be {'type': 'function', 'function': {'name': ..., ...}}")
        return v

    def conversation(self, mark: ContentMarker | None = None) -> list[Message]:
        """The messages as rlops records them (images through `mark`, see `ChatMessage.to_message`); `tools`
        are written into the system message in the `<tool_call>` format the service parses (small chat
        templates have no tool support)."""
        messages = [m.to_message(mark) for m in self.messages]
        if self.tools:
            if messages[0].role == "system":
                messages[0].content = render_system_prompt(messages[0].content or "", self.tools)
            else:
                messages.insert(0, Message("system", render_system_prompt("", self.tools)))
        return messages


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for /v1/completions
    logprobs: int | None = Field(None, ge=0, le=20)  # k: the sampled token's log-prob and the k most likely

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else self.prompt


def visible_text(text: str, stops: list[str]) -> str:
    """The sampled text as OpenAI returns it: cut before the first stop string."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(cuts)] if cuts else text


def stop_hit(text: str, stops: list[str]) -> str | None:
    """The stop string that ended the sampled text (the earliest in it), None when none did."""
    found = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    return min(found)[1] if found else None


def without_tool_calls(text: str) -> str | None:
    """The text outside the `<tool_call>` blocks (an unclosed block runs to the end); None if empty."""
    rest = TOOL_CALL_RE.sub("", text)
    rest = rest.split(OPEN_TAG, 1)[0].strip()
    return rest or None


_ID_RE = re.compile(r"[^A-Za-z0-9]")


def logprobs_content(tokenizer: Any, sample: Sample) -> list[dict[str, Any]]:
    """OpenAI's `logprobs.content`: one entry per sampled token (the final EOS included, since it
    was sampled and is trained on), with its `top_logprobs` alternatives when they were asked for."""

    def entry(token_id: int, lp: float) -> dict[str, Any]:
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": token, "logprob": lp, "bytes": list(token.encode())}

    tops = sample.top_logprobs or [[] for _ in sample.token_ids]
    return [entry(t, lp) | {"top_logprobs": [entry(a, alp) for a, alp in top]}
            for t, lp, top in zip(sample.token_ids, sample.logprobs, tops)]


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def call_id(response_id: str, index: int, call: int) -> str:
    """A tool-call id unique across the service: the clients send it back with the tool's result."""
    return f"call_{_ID_RE.sub('', response_id)[-12:]}_{index}_{call}"


class ResponsesRequest(_Request):
    """POST /v1/responses. `input` items: `message` (text content parts `input_text`/`output_text`),
    `function_call`, `function_call_output`; `tools` in the Responses shape
    ({type: function, name, description, parameters, strict})."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None  # the system message
    tools: list[dict[str, Any]] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    previous_response_id: str | None = None  # prepend a conversation the server stored
    store: bool | None = None  # false: not kept for previous_response_id
    metadata: dict[str, Any] | None = None  # echoed back
    user: str | None = None  # the episode id when no X-Episode-Id header is sent
    top_logprobs: Literal[0] | None = None  # only the sampled token's log-prob is recorded
    # Honoured as chat's (stages/service/decoding.py); Responses' named form is {type: function, name}.
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("tools")
    @classmethod
    def _functions(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for spec in v or []:
            if spec.get("type") != "function" or not spec.get("name"):
                raise ValueError("each tool must be {'type': 'function', 'name': ..., 'parameters': ...}: "
                                 "built-in tools are not implemented")
        return v

    @field_validator("input")
    @classmethod
    def _items(cls, v: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        for k, item in enumerate([] if isinstance(v, str) else v):
            kind = item.get("type", "message" if "role" in item else None)
            need = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
                    "function_call_output": ("call_id", "output")}.get(kind)
            if need is None:
                raise ValueError(f"item {k}: type {kind!r} is not implemented "
                                 "(message, function_call, function_call_output are)")
            if missing := [f for f in need if f not in item]:
                raise ValueError(f"item {k} ({kind}) lacks {', '.join(missing)}")
            content = item["content"] if kind == "message" else item.get("output")
            for part in [] if isinstance(content, str) else content or []:
                if part.get("type") not in ("input_text", "output_text", "text", "input_image"):
                    raise ValueError(f"item {k}: content part {part.get('type')!r} is not implemented "
                                     "(input_text, output_text, input_image are)")
                if part["type"] == "input_image" and not isinstance(part.get("image_url"), str):
                    raise ValueError(f"item {k}: an input_image part needs image_url (a data URL); file_id is not "
                                     "implemented")
        return v

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The tools in the chat shape."""
        if not self.tools:
            return None
        return [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
                for t in self.tools]

    def messages(self) -> list[dict[str, Any]]:
        """`input` as chat messages (instructions not included): an assistant message followed by
        function_call items is one assistant turn with those tool calls, as the service returned it; a
        content with `input_image` parts as chat's `image_url` parts."""
        if isinstance(self.input, str):
            return [Message("user", self.input).to_openai()]
        out: list[Message] = []
        contents: dict[int, list[dict[str, Any]]] = {}  # message index -> its chat parts, when it holds images
        for item in self.input:
            kind = item.get("type", "message")
            if kind == "message":
                role = "system" if item["role"] == "developer" else item["role"]
                out.append(Message(role, _text(item["content"])))
            elif kind == "function_call":
                call = ToolCall(item["call_id"], item["name"], item["arguments"])
                if out and out[-1].role == "assistant" and out[-1].tool_call_id is None:
                    out[-1].tool_calls.append(call)
                else:
                    out.append(Message("assistant", None, [call]))
            else:
                out.append(Message("tool", _text(item["output"]), tool_call_id=item["call_id"]))
            raw = item.get("content", item.get("output"))
            if kind != "function_call" and not isinstance(raw, str) and any(p.get("type") == "input_image" for p in raw):
                contents[len(out) - 1] = [{"type": "image_url", "image_url": {"url": p["image_url"]}}
                                          if p.get("type") == "input_image" else {"type": "text", "text": p.get("text", "")}
                                          for p in raw]
        return [m.to_openai() | ({"content": contents[k]} if k in contents else {}) for k, m in enumerate(out)]


def _text(content: str | list[dict[str, Any]]) -> str:
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
