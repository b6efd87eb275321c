"""The policy service: what answers each request, batched generation over a resident policy, recording tokens.

    resolve, names = catalog_resolver(checkpoints_file, base)  # stages/service/resolve.py
    service = PolicyService(ResidentPolicy.load(base), resolve, names=names)
    body = await service.chat_completion(request, caller)       # what POST /v1/chat/completions returns

The HTTP app around it is stages/service/app.py (the legacy `/v1/completions` endpoint: completions.py).
The `model` field names a policy, resolved per request
(stages/service/resolve.py); adapters are hot-loaded by the resident policy.

Episodes: a call is recorded under its caller's episode id (stages/service/served.py: the URL's, else its
`X-Episode-Id` header, else its `user` field); a call with none is served but not recorded. See
stages/service/recorder.py. A service with a `sink` (`rlops serve`) also hands it every answered chat call (chat
completions, Responses, Messages) as a `ServedCall`, which the traffic log keeps (storage/traffic.py).

Batching: requests wait in a queue; the batcher thread takes the first, collects whatever else
arrives within `batch_window_s`, and generates each group of requests with the same policy and
sampling settings in one `generate` call (n > 1 is n prompts of that call). A request with a
`seed` is generated alone, so the same request with the same seed repeats exactly; unseeded calls
draw their batch seed from the service's seeded stream.

Images: a vision-language base (`stages.policy.vlm_resident.VisualResidentPolicy`) takes `image_url`
parts; each request's images are validated and stored in the workspace's image store before any
compute (`_conversation`: at most `max_images`, local files only under `image_root`), referenced from the
records by id, and expanded into placeholder tokens by the policy's `VisualChatFormat`. A request with
images is generated alone (its n samples share its pixel inputs); the recorder keeps each call's image ids.
A text-only policy answers an image with a 400.

A refused request raises `ServiceError` with its HTTP status, OpenAI error code and the field it names
(the app turns it into an OpenAI-style error body).
"""

from __future__ import annotations

import asyncio
import queue
import random
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from stages.policy.chat import ChatFormat
from stages.policy.resident import ResidentPolicy
from stages.policy.sampling import RowOptions, Sample, SamplingConfig, decode_turn
from stages.policy.vlm_chat import image_ids_of, marked_content
from stages.policy.vlm_resident import DEFAULT_MAX_IMAGES, VisualResidentPolicy
from stages.service.decoding import request_decoding
from stages.service.recorder import Call, Completion, Recorder, assemble, chat_prompt
from stages.service.resolve import EpisodePins, Names, Resolver
from stages.service.served import Caller, ServedCall
from stages.service.schemas import (ChatRequest, ContentMarker, call_id, logprobs_content, stop_hit, visible_text,
                                    without_tool_calls)
from stages.service.stream import ChoiceText, TokenFeed, chat_sse
from storage.schema import Message, ToolCall
from tasks.base import parse_tool_calls


class ServiceError(Exception):
    """A request the service refuses, with its HTTP status, OpenAI error code and the request field it names."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


@dataclass(frozen=True)
class ServiceConfig:
    """How the service samples and batches."""

    default_max_tokens: int = 256  # a chat request without max_tokens: one tool call or a short answer
    # Wait this long after the first queued request for others to share its generate call: agents'
    # next calls arrive within milliseconds of each other, a CPU turn takes seconds.
    batch_window_s: float = 0.05
    max_batch: int = 64  # prompts per generate call: bounds the KV cache memory
    # The rollout stage forces the run's temperature and top_p (the GRPO ratio needs the sampling
    # temperature) and caps max_tokens; None lets each request choose.
    forced: SamplingConfig | None = None
    max_total_tokens: int | None = None  # rollout: an episode's whole sequence (prompt + completion)
    seed: int = 0  # the stream of batch seeds for unseeded requests
    # A vision-language policy's images per request (the whole conversation's): each is tens to hundreds of
    # prompt tokens and its pixels a forward pass's memory, so a bound refuses a runaway agent before compute.
    max_images: int = DEFAULT_MAX_IMAGES
    # Where `image_url`s naming local files (file:// or a path) may be read from; None: data URLs only.
    image_root: Path | None = None


@dataclass
class _Job:
    policy_id: str
    adapter_dir: str | None
    prompts: list[list[int]]
    sampling: SamplingConfig
    seed: int | None
    options: RowOptions = RowOptions()  # per prompt: top log-probs, a constraint (rows differing here share a call)
    future: Future = field(default_factory=Future)
    # A streamed request's feed: gets (prompt index, token) pairs of each decoding step.
    on_step: Callable[[list[tuple[int, int]]], None] | None = None
    images: list[str] = field(default_factory=list)  # a VLM request's image ids (every prompt's), in placeholder order


class PolicyService:
    """The model, the recorder and the batcher behind the HTTP app."""

    def __init__(self, policy: ResidentPolicy, resolve: Resolver, config: ServiceConfig = ServiceConfig(),
                 names: Names = lambda: [], in_flight: Callable[[], int] | None = None,
                 sink: Callable[[ServedCall], None] | None = None) -> None:
        """`in_flight`, when the caller knows it (the rollout stage), is the number of episodes
        still running: a batch is generated as soon as each of them has a request queued, instead
        of waiting out the window, and a slow straggler delays the others by the window at most.
        `sink` gets each answered chat call (`rlops serve`'s traffic log)."""
        self.policy, self.resolve, self.config, self.names, self.sink = policy, resolve, config, names, sink
        self.pinned = EpisodePins(resolve)  # an episode stays on the policy its first call resolved
        self.in_flight = in_flight
        # A vision-language policy's format expands image references into placeholder tokens (vlm_chat.py).
        self.vision = policy if isinstance(policy, VisualResidentPolicy) else None
        self.chat = self.vision.chat if self.vision else ChatFormat(policy.tokenizer)
        # How a message content becomes a record's: images stored and referenced; None: a text policy takes none.
        self.mark: ContentMarker | None = self._mark if self.vision else None
        self.recorder = Recorder()
        self.generate_calls = 0  # generate calls made (batching is visible in tests and benchmarks)
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._seeds = random.Random(config.seed)
        self._thread = threading.Thread(target=self._batch_loop, name="policy-batcher", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    # -- sampling --------------------------------------------------------------------------

    def sampling(self, temperature: float | None, top_p: float | None, max_tokens: int | None,
                 stop: list[str], prompt_len: int) -> SamplingConfig:
        """The request's sampling settings, with the forced ones applied and max_tokens fitted to
        the context (and to the episode budget in a rollout)."""
        forced = self.config.forced
        limit = self.policy.max_context
        if self.config.max_total_tokens is not None:
            limit = min(limit, self.config.max_total_tokens)
        room = limit - prompt_len
        if room < 1:
            raise ServiceError(400, f"the prompt has {prompt_len} tokens; the limit is {limit}", "context_length_exceeded")
        wanted = max_tokens or self.config.default_max_tokens
        if forced is not None:
            wanted = min(wanted, forced.max_new_tokens)
            temperature, top_p, stop = forced.temperature, forced.top_p, list(forced.stop) + stop
        return SamplingConfig(temperature=1.0 if temperature is None else temperature,
                              top_p=1.0 if top_p is None else top_p,
                              max_new_tokens=min(wanted, room), stop=tuple(stop))

    async def generate(self, model: str, prompts: list[list[int]], sampling: SamplingConfig, seed: int | None,
                       options: RowOptions = RowOptions(), images: list[str] | None = None,
                       episode: str | None = None) -> tuple[str, list[Sample]]:
        """Queue prompts for the batcher; returns (policy id, one sample per prompt)."""
        job = self.submit(model, prompts, sampling, seed, options, images=images, episode=episode)
        return job.policy_id, await asyncio.wrap_future(job.future)

    def submit(self, model: str, prompts: list[list[int]], sampling: SamplingConfig, seed: int | None,
               options: RowOptions = RowOptions(), on_step: Callable[[list[tuple[int, int]]], None] | None = None,
               images: list[str] | None = None, episode: str | None = None) -> _Job:
        """Queue prompts for the batcher (an unknown model is refused here, before any streaming starts);
        the job's future gets one sample per prompt. `images`: the image ids every prompt's placeholders
        stand for (a vision-language policy). `episode`: the call's episode, which keeps its first policy."""
        try:
            policy_id, adapter_dir = self.pinned(model, episode)
        except KeyError as e:
            self.recorder.count_unrecorded(unknown_model=model)
            raise ServiceError(404, e.args[0] if e.args else f"unknown model {model!r}", "model_not_found") from None
        job = _Job(policy_id, adapter_dir, prompts, sampling, seed, options, on_step=on_step, images=images or [])
        self._queue.put(job)
        return job

    def _batch_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            jobs = [first]
            deadline = time.monotonic() + self.config.batch_window_s
            while (left := deadline - time.monotonic()) > 0 and not (self.in_flight and len(jobs) >= self.in_flight()):
                try:
                    job = self._queue.get(timeout=left)
                except queue.Empty:
                    break
                if job is None:
                    self._queue.put(None)  # stop after this batch
                    break
                jobs.append(job)
            # Requests differing only in max_tokens share a call (generating to the largest, each
            # cut to its own): near the end of a context or episode budget they all differ.
            groups: dict[tuple, list[_Job]] = {}
            for job in jobs:
                # A seeded request repeats exactly when alone; a request with images has its own pixel inputs.
                alone = id(job) if job.seed is not None or job.images else None
                shared = replace(job.sampling, max_new_tokens=0)
                groups.setdefault((job.policy_id, job.adapter_dir, shared, alone), []).append(job)
            for group in groups.values():
                self._run(group)

    def _run(self, jobs: list[_Job]) -> None:
        """Generate a group in calls of at most max_batch prompts; every job gets its samples or the error."""
        prompts = [(j, k, p) for j in jobs for k, p in enumerate(j.prompts)]
        out: dict[int, list[Sample]] = {id(j): [] for j in jobs}
        try:
            for start in range(0, len(prompts), self.config.max_batch):
                chunk = prompts[start : start + self.config.max_batch]
                seed = jobs[0].seed if jobs[0].seed is not None else self._seeds.randrange(2**31)
                sampling = replace(jobs[0].sampling, max_new_tokens=max(j.sampling.max_new_tokens for j, _, _ in chunk))
                images = {"images": jobs[0].images} if jobs[0].images else {}  # then the group is that one job
                samples = self.policy.generate(jobs[0].policy_id, jobs[0].adapter_dir, [p for _, _, p in chunk],
                                               sampling, seed, rows=[j.options for j, _, _ in chunk],
                                               on_step=_fan_out(chunk), **images)
                self.generate_calls += 1
                for (job, _, _), sample in zip(chunk, samples):
                    out[id(job)].append(self._cut(sample, job.sampling.max_new_tokens))
        except Exception as e:  # noqa: BLE001 - reported to each waiting request as a 500, the loop goes on
            for job in jobs:
                job.future.set_exception(e)
            return
        for job in jobs:
            job.future.set_result(out[id(job)])

    def _cut(self, sample: Sample, max_new_tokens: int) -> Sample:
        """A sample cut to its own request's max_tokens (a batch generates to the largest)."""
        if len(sample.token_ids) <= max_new_tokens:
            return sample
        ids = sample.token_ids[:max_new_tokens]
        top = sample.top_logprobs[:max_new_tokens] if sample.top_logprobs is not None else None
        return replace(sample, token_ids=ids, logprobs=sample.logprobs[:max_new_tokens], top_logprobs=top,
                       text=decode_turn(self.policy.tokenizer, ids, self.policy.eos_ids), finish_reason="length")

    # -- endpoints -------------------------------------------------------------------------

    def _chat_setup(self, req: ChatRequest, caller: Caller
                    ) -> tuple[ChatRequest, RowOptions, Any, list[int], list[Message], SamplingConfig]:
        """The request as served (stages/service/decoding.py), its sampler options, the episode log, prompt
        ids, conversation as the model sees it, and sampling of a chat request."""
        req, options = self._decoding(req)
        conversation = self._conversation(req)
        log = self.recorder.get(caller.episode) if caller.episode else None
        prompt, seen = chat_prompt(self.chat, conversation, log, self.policy.eos_ids)
        sampling = self.sampling(req.temperature, req.top_p, req.max_completion_tokens or req.max_tokens,
                                 req.stop, len(prompt))
        return req, options, log, prompt, seen, sampling

    def _chat_choices(self, req: ChatRequest, rid: str, log: Any, prompt: list[int], seen: list[Message],
                      sampling: SamplingConfig, samples: list[Sample], caller: Caller, policy_id: str) -> list[dict[str, Any]]:
        """The response's choices; records the call (streamed or not, the same record) and hands it to the sink.
        A constraint that left a row no token is a 500 naming it: no broken turn is returned or recorded."""
        failed = next((s.error for s in samples if s.error), None)
        if failed:
            raise ServiceError(500, failed)
        choices, recorded, returned = [], [], []
        for i, s in enumerate(samples):
            # Tool calls only when the request offers tools: otherwise the text is the answer, as it was
            # sampled (a judge asked for JSON must not lose a `<tool_call>`-looking span of it).
            found = parse_tool_calls(s.text, 0) if req.tools else []
            calls = [ToolCall(call_id(rid, i, k), c.name, c.arguments) for k, c in enumerate(found)]
            text = visible_text(s.text, list(sampling.stop))
            shown = Message("assistant", without_tool_calls(text) if req.tools else text, calls)
            # A call cut off by max_tokens is "length", as OpenAI says it: the agent must not run half a call.
            finish = "tool_calls" if calls and s.finish_reason != "length" else s.finish_reason
            recorded.append(Completion(prompt, s.token_ids, s.logprobs, Message("assistant", s.text, calls), s.finish_reason,
                                       s.constraint, self._images(seen)))
            returned.append(shown)
            # `stop_reason` as vLLM returns it: the stop string that ended the turn (Anthropic's `stop_sequence`).
            choices.append({"index": i, "message": shown.to_openai() | {"content": shown.content},
                            "finish_reason": finish, "stop_reason": stop_hit(s.text, list(sampling.stop)),
                            "logprobs": {"content": logprobs_content(self.policy.tokenizer, s)} if req.logprobs else None})
        if log is not None:
            log.add(Call(seen, recorded), returned)
        if self.sink is not None:
            self.sink(ServedCall(caller, rid, req.model, policy_id, seen, req.tools, prompt, samples[0],
                                 choices[0]["finish_reason"], req.n, sampling, req.seed))
        return choices

    def prompt_tokens(self, req: ChatRequest, episode_id: str | None) -> int:
        """How many tokens the request's prompt is, built as `_chat_setup` builds it (the episode's
        recognised turns as their recorded tokens), with nothing generated or recorded."""
        req, _ = self._decoding(req)
        conversation = self._conversation(req)
        log = self.recorder.peek(episode_id) if episode_id else None
        return len(chat_prompt(self.chat, conversation, log, self.policy.eos_ids)[0])

    def _conversation(self, req: ChatRequest) -> list[Message]:
        """The request's messages as records, each image validated and stored (referenced by id: vlm_chat.py),
        before any compute. 400 naming the problem: an image for a text-only policy, more images than
        `max_images`, an image that does not decode, an unsupported format, a file outside the image root."""
        with_images = [k for k, m in enumerate(req.messages) if m.has_images()]
        if with_images and self.vision is None:
            raise ServiceError(400, "image_url content parts need a vision-language policy; this service's policy "
                                    "is text-only", param=f"messages.{with_images[0]}.content")
        count = sum(m.image_count() for m in req.messages)
        if count > self.config.max_images:
            raise ServiceError(400, f"the request holds {count} images; this service takes at most "
                                    f"{self.config.max_images} per request (max_images)", "too_many_images", "messages")
        try:
            return req.conversation(self.mark)
        except ValueError as e:
            raise ServiceError(400, str(e), "invalid_image") from None

    def _mark(self, content: str | list[dict[str, Any]] | None) -> str | None:
        return marked_content(content, self.vision.vlm.store, self.config.image_root)

    def _images(self, seen: list[Message]) -> list[str]:
        """The ids of the images a prompt built from `seen` holds, in placeholder order ([] for a text policy)."""
        return image_ids_of(seen) if self.vision else []

    async def chat_completion(self, req: ChatRequest, caller: Caller) -> dict[str, Any]:
        req, options, log, prompt, seen, sampling = self._chat_setup(req, caller)
        policy_id, samples = await self.generate(req.model, [prompt] * req.n, sampling, req.seed, options,
                                                 self._images(seen), caller.episode)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": req.model,
                "choices": self._chat_choices(req, rid, log, prompt, seen, sampling, samples, caller, policy_id),
                "usage": usage(len(prompt), samples)}

    def chat_deltas(self, req: ChatRequest, caller: Caller) -> tuple[str, int, AsyncIterator[tuple]]:
        """Start a chat request's generation and return (response id, prompt tokens, its events): ("text", choice,
        settled content), then ("end", choices as a plain response has them, the content each choice
        still has to send, usage) or ("error", message). A request refused before generation raises
        here, so it is an ordinary HTTP error; the recording is the plain call's (`_chat_choices`)."""
        req, options, log, prompt, seen, sampling = self._chat_setup(req, caller)
        feed = TokenFeed()
        job = self.submit(req.model, [prompt] * req.n, sampling, req.seed, options, on_step=feed.on_step,
                          images=self._images(seen), episode=caller.episode)
        feed.watch(job.future)
        rid = f"chatcmpl-{uuid.uuid4().hex}"

        async def events() -> AsyncIterator[tuple]:
            texts = [ChoiceText(sampling.max_new_tokens, self.policy.eos_ids) for _ in range(req.n)]
            async for step in feed.steps():
                for i, token in step:
                    if texts[i].add(token) and (text := texts[i].delta(self.policy.tokenizer, sampling.stop, bool(req.tools))):
                        yield ("text", i, text)
            try:
                samples = job.future.result()
                choices = self._chat_choices(req, rid, log, prompt, seen, sampling, samples, caller, job.policy_id)
            except Exception as e:  # noqa: BLE001 - the stream has started: the error ends it as an event
                yield ("error", f"{type(e).__name__}: {e}")
                return
            yield ("end", choices, [texts[c["index"]].rest(c["message"]["content"]) for c in choices],
                   usage(len(prompt), samples))

        return rid, len(prompt), events()

    def chat_completion_stream(self, req: ChatRequest, caller: Caller) -> AsyncIterator[str]:
        """The Server-Sent Events of a streamed chat completion (stages/service/stream.py)."""
        rid, _, events = self.chat_deltas(req, caller)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return chat_sse(rid, req.model, req.n, include_usage, events)

    def _decoding(self, req: ChatRequest) -> tuple[ChatRequest, RowOptions]:
        """The request's decoding fields as sampler options (stages/service/decoding.py); a field the
        service cannot honour is a 400 naming it."""
        try:
            return request_decoding(req, self.policy.tokenizer, self.policy.eos_ids)
        except ValueError as e:
            raise ServiceError(400, str(e)) from None

    def episode(self, episode_id: str) -> dict[str, Any]:
        log = self.recorder.peek(episode_id)
        if log is None or not log.calls:
            raise ServiceError(404, f"no recorded calls for episode {episode_id!r}", "episode_not_found")
        t = assemble(log)
        return {"episode_id": episode_id, "token_ids": t.token_ids, "loss_mask": t.loss_mask,
                "behavior_logprobs": t.behavior_logprobs, "segment_starts": t.segment_starts, "constraints": t.constraints,
                "image_ids": t.image_ids,
                "num_turns": t.num_turns, "messages": [m.to_openai() for m in t.messages]}


def _fan_out(chunk: list[tuple[_Job, int, list[int]]]) -> Callable[[list[int]], None] | None:
    """The callback handing each decoding step's tokens (one per row of `chunk`) to the streamed jobs
    among the rows; None when no row streams."""
    if not any(job.on_step for job, _, _ in chunk):
        return None

    def on_step(tokens: list[int]) -> None:
        per_job: dict[int, tuple[_Job, list[tuple[int, int]]]] = {}
        for (job, k, _), token in zip(chunk, tokens):
            if job.on_step is not None:
                per_job.setdefault(id(job), (job, []))[1].append((k, token))
        for job, pairs in per_job.values():
            job.on_step(pairs)

    return on_step


def usage(prompt_tokens: int, samples: list[Sample]) -> dict[str, int]:
    """The OpenAI `usage` object of a response."""
    completion = sum(len(s.token_ids) for s in samples)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
