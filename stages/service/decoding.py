"""What a chat request asks of the sampler: `tool_choice`, `response_format`, `parallel_tool_calls`,
`logprobs` / `top_logprobs`, turned into the request's `RowOptions` (stages/policy/sampling.py).

    req, options = request_decoding(req, tokenizer, eos_ids)   # ValueError naming the field if refused

A value the service cannot honour is refused (a 400 naming the field), never ignored.
"""

from __future__ import annotations

from typing import Any

from stages.policy.sampling import RowOptions
from stages.service.schemas import ChatRequest


def request_decoding(req: ChatRequest, tokenizer: Any, eos_ids: set[int]) -> tuple[ChatRequest, RowOptions]:
    """The request as the service serves it and its sampler options; ValueError("<field>: why") when refused."""
    top = req.top_logprobs or 0
    if top and not req.logprobs:
        raise ValueError("top_logprobs: needs logprobs: true")
    return req, RowOptions(top_logprobs=top if req.logprobs else 0)
