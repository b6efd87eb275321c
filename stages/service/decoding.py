"""What a chat request asks of the sampler: `tool_choice`, `parallel_tool_calls`, `response_format` and
`logprobs` / `top_logprobs`, turned into the request's `RowOptions` (stages/policy/sampling.py).

    req, options = request_decoding(req, tokenizer, eos_ids)   # ValueError("<field>: why") if refused

| field | what the service does |
| --- | --- |
| `tool_choice` "auto" / omitted | unconstrained; tool calls are parsed from the text |
| `tool_choice` "none" | the tools are not offered (not written into the system message) and nothing is parsed |
| `tool_choice` "required" | constrained: one or more `<tool_call>` blocks of the offered tools, arguments valid against their schemas, then EOS |
| `tool_choice` {type: function, function: {name}} | the same with that tool only (a name not in `tools` is a 400) |
| `parallel_tool_calls` false | at most one call in a constrained turn |
| `response_format` text | unconstrained |
| `response_format` json_object / json_schema | constrained to a JSON object / JSON valid against `json_schema.schema` (`strict` or not); with tools and `tool_choice` auto, tool calls or that JSON; under "required" or a named tool the calls win (there is no answer text to shape) |
| `top_logprobs` k <= 20 (with `logprobs: true`) | the k most likely tokens per step |

Anything else of these fields (another `tool_choice` or `response_format` type, "required" without
tools, a schema llguidance cannot compile, `top_logprobs` without `logprobs`) is refused with a
ValueError naming the field, which the service turns into a 400: never a silent no-op.
"""

from __future__ import annotations

from typing import Any

from stages.policy.constrain import check, json_constraint, tool_call_constraint, tool_call_or_json_constraint
from stages.policy.sampling import Constraint, RowOptions
from stages.service.schemas import ChatRequest


def request_decoding(req: ChatRequest, tokenizer: Any, eos_ids: set[int]) -> tuple[ChatRequest, RowOptions]:
    """The request as the service serves it (without its tools under `tool_choice: "none"`) and its
    sampler options; ValueError("<field>: why") when a field cannot be honoured."""
    top = req.top_logprobs or 0
    if top and not req.logprobs:
        raise ValueError("top_logprobs: needs logprobs: true")
    tools, parallel = req.tools or [], req.parallel_tool_calls is not False
    only, calls = _tool_choice(req.tool_choice, tools)
    schema, fmt = _response_format(req.response_format)
    if req.tool_choice == "none":
        req, tools = req.model_copy(update={"tools": None}), []
    constraint: Constraint | None = None
    if calls:
        name = f"function:{only}" if only else "required"
        constraint = tool_call_constraint(tools, only=only, parallel=parallel, label=f"tool_choice={name}")
    elif schema is not None and tools:
        constraint = tool_call_or_json_constraint(tools, parallel, schema, label=f"tool_choice=auto+response_format={fmt}")
    elif schema is not None:
        constraint = json_constraint(schema, label=f"response_format={fmt}")
    if constraint is not None:
        if schema is not None and (problem := check(json_constraint(schema, ""), tokenizer, eos_ids)):
            raise ValueError(f"response_format: the schema cannot be used for constrained decoding: {problem}")
        if problem := check(constraint, tokenizer, eos_ids):
            raise ValueError(f"tools: a tool's parameters schema cannot be used for constrained decoding "
                             f"(tool_choice {req.tool_choice!r}): {problem}")
    return req, RowOptions(top_logprobs=top if req.logprobs else 0, constraint=constraint)


def _tool_choice(choice: str | dict[str, Any] | None, tools: list[dict[str, Any]]) -> tuple[str | None, bool]:
    """(the one tool a turn must call or None, whether the turn must be tool calls)."""
    if choice is None or choice in ("auto", "none"):
        return None, False
    names = [t["function"]["name"] for t in tools]
    if choice == "required":
        if not tools:
            raise ValueError("tool_choice: 'required' needs tools")
        return None, True
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if isinstance(fn, dict) and isinstance(fn.get("name"), str):
        if fn["name"] not in names:
            raise ValueError(f"tool_choice: names the tool {fn['name']!r}, which is not in tools {names}")
        return fn["name"], True
    raise ValueError(f"tool_choice: unsupported value {choice!r}; rlops takes 'auto', 'none', 'required' "
                     "or {'type': 'function', 'function': {'name': ...}}")


def _response_format(fmt: dict[str, Any] | None) -> tuple[dict[str, Any] | None, str]:
    """(the JSON schema a plain answer must follow or None, the format's type)."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None, kind
    if kind == "json_object":
        return {"type": "object"}, kind
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format: json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
        return spec["schema"], kind
    raise ValueError(f"response_format: unsupported type {kind!r}; rlops takes 'text', 'json_object' or 'json_schema'")
