"""The legacy text completions endpoint (`POST /v1/completions`) of the policy service: raw prompts, no chat
template, plain and streamed; each choice recorded as a one-message call of its episode.

    body = await completion(service, request, episode_id)             # what the endpoint returns
    events = completion_stream(service, request, episode_id)          # its Server-Sent Events
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from stages.policy.sampling import RowOptions, Sample, SamplingConfig
from stages.service.recorder import Call, Completion
from stages.service.schemas import CompletionRequest, logprobs_content, visible_text
from stages.service.service import PolicyService, ServiceError, usage
from stages.service.stream import ChoiceText, TokenFeed, completion_sse
from storage.schema import Message


def _setup(service: PolicyService, req: CompletionRequest) -> tuple[list[list[int]], SamplingConfig]:
    prompts = [service.policy.tokenizer(p, add_special_tokens=False)["input_ids"] for p in req.prompts()]
    if any(not p for p in prompts):
        raise ServiceError(400, "prompt must not be empty")
    return prompts, service.sampling(req.temperature, req.top_p, req.max_tokens, req.stop, max(map(len, prompts)))


def _choices(service: PolicyService, req: CompletionRequest, episode_id: str | None, prompts: list[list[int]],
             sampling: SamplingConfig, samples: list[Sample]) -> list[dict[str, Any]]:
    """The response's choices; records each (streamed or not, the same record)."""
    log = service.recorder.get(episode_id) if episode_id else None
    choices = []
    for i, s in enumerate(samples):
        prompt = prompts[i // req.n]
        if log is not None:
            log.add(Call([Message("user", req.prompts()[i // req.n])],
                         [Completion(prompt, s.token_ids, s.logprobs, Message("assistant", s.text), s.finish_reason)]), [])
        lp = None
        if req.logprobs is not None:
            entries = logprobs_content(service.policy.tokenizer, s)
            lp = {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                  "top_logprobs": [{a["token"]: a["logprob"] for a in e["top_logprobs"]} for e in entries]
                  if req.logprobs else None, "text_offset": None}
        choices.append({"index": i, "text": visible_text(s.text, list(sampling.stop)),
                        "finish_reason": s.finish_reason, "logprobs": lp})
    return choices


async def completion(service: PolicyService, req: CompletionRequest, episode_id: str | None) -> dict[str, Any]:
    """The response body of a (non-streamed) completions request."""
    prompts, sampling = _setup(service, req)
    _, samples = await service.generate(req.model, [p for p in prompts for _ in range(req.n)], sampling, req.seed,
                                        RowOptions(top_logprobs=req.logprobs or 0), episode=episode_id)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": req.model, "choices": _choices(service, req, episode_id, prompts, sampling, samples),
            "usage": usage(sum(map(len, prompts)), samples)}


def completion_stream(service: PolicyService, req: CompletionRequest, episode_id: str | None) -> AsyncIterator[str]:
    """The Server-Sent Events of a streamed completion: text deltas per choice index, then each
    choice's finish chunk, the usage chunk if asked, `[DONE]` (stages/service/stream.py)."""
    prompts, sampling = _setup(service, req)
    feed = TokenFeed()
    job = service.submit(req.model, [p for p in prompts for _ in range(req.n)], sampling, req.seed,
                         RowOptions(top_logprobs=req.logprobs or 0), on_step=feed.on_step, episode=episode_id)
    feed.watch(job.future)

    async def events() -> AsyncIterator[tuple]:
        texts = [ChoiceText(sampling.max_new_tokens, service.policy.eos_ids) for _ in job.prompts]
        async for step in feed.steps():
            for i, token in step:
                if texts[i].add(token) and (t := texts[i].delta(service.policy.tokenizer, sampling.stop, False)):
                    yield ("text", i, t)
        try:
            samples = job.future.result()
        except Exception as e:  # noqa: BLE001 - the stream has started: the error ends it as an event
            yield ("error", f"{type(e).__name__}: {e}")
            return
        choices = _choices(service, req, episode_id, prompts, sampling, samples)
        yield ("end", choices, [texts[c["index"]].rest(c["text"]) for c in choices],
               usage(sum(map(len, prompts)), samples))

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return completion_sse(f"cmpl-{uuid.uuid4().hex}", req.model, include_usage, events())

