"""The OpenAI request and response shapes of the policy service, and their conversions.

Requests are validated with pydantic: a malformed one (a missing field, a wrong type, an unknown
role, `stream: true`, ...) is a 400 with an OpenAI-style error body, built in stages/service/app.py.
Only the fields rlops implements are read; other OpenAI fields (`stream_options`, ...) are accepted
and ignored, as vLLM does. `tool_choice`, `parallel_tool_calls`, `response_format` and `top_logprobs`
are honoured or refused by stages/service/decoding.py.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from stages.policy.sampling import Sample
from storage.schema import Message, ToolCall
from tasks.base import OPEN_TAG, TOOL_CALL_RE, render_system_prompt


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


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def to_message(self) -> Message:
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        calls = [ToolCall(c.id, c.function.name, c.function.arguments) for c in self.tool_calls or []]
        role = "system" if self.role == "developer" else self.role  # chat templates know "system"
        return Message(role, content, calls, self.tool_call_id, self.name)


class _Sampling(_Lenient):
    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = Field(None, validate_default=True)
    n: int = Field(1, ge=1, le=64)
    seed: int | None = None
    user: str | None = None  # the episode id when no X-Episode-Id header is sent
    stream: Literal[False] = False  # streaming is not implemented: `stream: true` is a 400

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

    @field_validator("tools")
    @classmethod
    def _functions(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for spec in v or []:
            if spec.get("type") != "function" or not isinstance(spec.get("function"), dict) \
                    or not spec["function"].get("name"):
                raise ValueError("each tool must be {'type': 'function', 'function': {'name': ..., ...}}")
        return v

    def conversation(self) -> list[Message]:
        """The messages as rlops records them; `tools` are written into the system message in the
        `<tool_call>` format the service parses (small chat templates have no tool support)."""
        messages = [m.to_message() for m in self.messages]
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
