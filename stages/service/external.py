"""Rollouts of an external agent (tasks/agent.py) through the policy service.

For one shard of groups: serve the policy (on 127.0.0.1 and a free port unless the rollout config's
`serve_host`/`serve_port` say otherwise) with the run's sampling forced, run every episode of the
shard concurrently through the user's `rollout(client, model, prompt)` with a real
`openai.AsyncOpenAI` client whose requests carry the episode id (or `rollout(endpoint, prompt)` with
the episode's `tasks.agent.Endpoint`; a sync one in a thread per episode), or by POSTing it to the agent
service of a `url` task (tasks/agent.py, told the `advertise_url`), then turn
each episode's recorded calls into one rollout row (stages/service/recorder.py: one segment when every
prompt extended the last, several otherwise). Concurrent episodes share generate calls: the
service batches whatever arrives together.

Reproducibility: the service draws batch seeds from a stream seeded by the shard's seed, but which
requests share a batch depends on when the agents send them, so an external agent's batch is not
bit-for-bit repeatable the way the built-in loop's is.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa

from stages.policy.resident import ResidentPolicy
from stages.policy.sampling import SamplingConfig
from stages.service.app import EPISODE_HEADER, ServerThread, build_app
from stages.service.recorder import EpisodeLog, assemble, fingerprint
from stages.service.resolve import fixed_resolver
from stages.service.schemas import ChatMessage, ContentMarker
from stages.service.service import PolicyService, ServiceConfig
from storage.schema import Message, Rollout, to_table
from tasks.agent import Endpoint
from tasks.base import AgentSpec, Prompt
from tasks.histories import framework_of, is_framework_history, to_chat_messages

# The longest a queued request waits for the other running episodes' requests: tools are usually
# milliseconds, a CPU generate call seconds.
BATCH_WINDOW_S = 1.0


def run_agent_shard(policy: ResidentPolicy, agent: AgentSpec, *, policy_id: str, adapter_dir: str | None,
                    task_name: str, sampling: SamplingConfig, group_size: int, max_total_tokens: int,
                    sampling_record: dict[str, Any], batch_id: str, split: str, groups: list[tuple[int, Prompt]],
                    base_seed: int, serve: tuple[str, int, str | None] = ("127.0.0.1", 0, None)) -> pa.Table:
    """One rollout row per episode of the shard's groups (G = `group_size` episodes per prompt), sampled from
    `policy_id` (its adapter folder; None for the base) on the resident `policy` with the run's `sampling`
    forced on every request and `max_total_tokens` per episode. `task_name` and `sampling_record` are what
    the rows' `task` and `sampling` columns store. `serve` is where the policy service listens (host,
    port; 0 = a free one) and the URL an agent service is told (None: the listening address)."""
    G = group_size
    resolve, names = fixed_resolver(policy_id, adapter_dir)
    episodes = [(f"{batch_id}-g{gi:05d}-s{s:03d}", prompt) for gi, prompt in groups for s in range(G)]
    running = _Running(len(episodes))
    # The batcher generates once every running episode has its next request queued (like the built-in
    # loop's lockstep turns); the window only bounds how long a slow agent or tool holds the others.
    service = PolicyService(policy, resolve, ServiceConfig(default_max_tokens=sampling.max_new_tokens, forced=sampling,
                                                           max_total_tokens=max_total_tokens, seed=base_seed,
                                                           batch_window_s=BATCH_WINDOW_S),
                            names, in_flight=lambda: running.count)
    try:
        host, port, advertise = serve
        with ServerThread(build_app(service), host=host, port=port) as url:
            # An in-process entry calls the local address; an agent service, the advertised one.
            public = (advertise or url).rstrip("/") if agent.url else url
            # A thread of its own: asyncio.run refuses to nest in a caller's running event loop.
            with ThreadPoolExecutor(1) as pool:
                outcomes = pool.submit(asyncio.run, _run_all(public, policy_id, agent, episodes, running)).result()
    finally:
        service.close()

    rows, errors = [], []
    for (rollout_id, prompt), (result, error, seconds) in zip(episodes, outcomes):
        gi, s = (int(x[1:]) for x in rollout_id.rsplit("-", 2)[1:])
        log = service.recorder.pop(rollout_id) or EpisodeLog()
        if error is None and not log.calls:  # an episode with nothing recorded is never an empty 'answer'
            error = service.recorder.why_empty(policy_id)
        try:
            fields = _fields(log, prompt, result, error, service.mark)
        except (TypeError, ValueError) as e:  # the agent returned something unusable: an error row too
            fields = _fields(log, prompt, None, f"{type(e).__name__}: {e}", service.mark)
        if fields["finish_reason"] == "error":
            errors.append(f"{rollout_id}: {fields['metadata']['error']}")
        rows.append(Rollout(
            rollout_id=rollout_id, batch_id=batch_id, policy_id=policy_id, task=task_name, split=split,
            prompt_id=prompt.prompt_id, group_id=f"{batch_id}-g{gi:05d}", sample_idx=s, sampling=sampling_record,
            seed=base_seed + gi * G + s, gen_seconds=seconds, **fields))
    if len(errors) > agent.max_error_frac * len(rows):
        raise RuntimeError(f"{len(errors)} of {len(rows)} agent episodes failed (max_error_frac={agent.max_error_frac}); "
                           f"first: {errors[0]}")
    return to_table(rows)


class _Running:
    """How many episodes of the shard are still running (read by the batcher thread)."""

    def __init__(self, count: int) -> None:
        self.count = count


async def _run_all(url: str, model: str, agent: AgentSpec, episodes: list[tuple[str, Prompt]],
                   running: _Running) -> list[tuple[Any, str | None, float]]:
    async def counted(eid: str, p: Prompt, http: Any = None, threads: Any = None) -> tuple[Any, str | None, float]:
        try:
            return await _one(url, model, agent, eid, p, http, threads)
        finally:
            running.count -= 1  # on the event loop thread only; the batcher just reads it

    if agent.url is None:
        # Not the loop's default executor (a handful of threads, joined when the loop closes): every
        # episode runs at once, and a sync agent overrunning its timeout is abandoned, not waited for.
        threads = ThreadPoolExecutor(max(len(episodes), 1), thread_name_prefix="rlops-agent")
        try:
            return await asyncio.gather(*(counted(eid, p, threads=threads) for eid, p in episodes))
        finally:
            threads.shutdown(wait=False, cancel_futures=True)
    import httpx

    # One connection per concurrent episode: the service may hold every one for a whole episode.
    async with httpx.AsyncClient(timeout=agent.episode_timeout,
                                 limits=httpx.Limits(max_connections=max(len(episodes), 1))) as http:
        return await asyncio.gather(*(counted(eid, p, http) for eid, p in episodes))


def agent_base_url(public: str, episode_id: str) -> str:
    """The policy service's OpenAI base URL as an agent service is told it. Episodes are told apart by
    the X-Episode-Id header; with an episode route in the URL this is the one line to change."""
    return f"{public}/v1"


async def _post(url: str, model: str, agent: AgentSpec, episode_id: str, prompt: Prompt,
                http: Any) -> tuple[Any, str | None, float]:
    """(result, error text or None, seconds) of one episode run by an agent service: an HTTP error, a
    timeout or a reply that is not a JSON object of {messages?, metadata?} is the error text."""
    import httpx

    body = {"prompt_id": prompt.prompt_id, "prompt": prompt.question, "base_url": agent_base_url(url, episode_id),
            "model": model, "episode_id": episode_id}
    start = time.monotonic()
    try:
        response = await asyncio.wait_for(http.post(agent.url, json=body), agent.episode_timeout)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        return None, f"TimeoutError: the agent service ran over {agent.episode_timeout:g} s", time.monotonic() - start
    except httpx.HTTPError as e:
        return None, f"the agent service failed: {type(e).__name__}: {e}"[:2000], time.monotonic() - start
    seconds = time.monotonic() - start
    if response.status_code != 200:
        return None, f"the agent service answered HTTP {response.status_code}: {response.text[:1000]}", seconds
    try:
        reply = response.json()
    except ValueError:
        return None, f"malformed reply (not JSON): {response.text[:500]!r}", seconds
    if not isinstance(reply, dict) or not isinstance(reply.get("messages") or [], list):
        return None, f"malformed reply: expected an object with optional 'messages' (a list) and 'metadata', " \
                     f"got {response.text[:500]!r}", seconds
    return {k: reply[k] for k in ("messages", "metadata") if reply.get(k) is not None}, None, seconds


async def _one(url: str, model: str, agent: AgentSpec, episode_id: str, prompt: Prompt,
               http: Any = None, threads: ThreadPoolExecutor | None = None) -> tuple[Any, str | None, float]:
    """(result, error text or None, seconds) of one episode; the agent's exceptions are data. A sync
    endpoint entry runs in `threads` (one thread per episode)."""
    if agent.url is not None:
        return await _post(url, model, agent, episode_id, prompt, http)
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="rlops-local", max_retries=0,
                                default_headers={EPISODE_HEADER: episode_id}, timeout=agent.episode_timeout)
    endpoint = Endpoint(base_url=f"{url}/ep/{episode_id}/v1", model=model, episode_id=episode_id,
                        headers={EPISODE_HEADER: episode_id}, timeout=agent.episode_timeout)
    start = time.monotonic()
    try:
        if agent.form == "client":
            running = agent.fn(client, model, prompt.question)
        elif agent.form == "prompt":  # an environment driver: the prompt's metadata holds its seed
            running = agent.fn(endpoint, prompt)
        elif inspect.iscoroutinefunction(agent.fn):
            running = agent.fn(endpoint, prompt.question)
        else:
            running = asyncio.get_running_loop().run_in_executor(threads, agent.fn, endpoint, prompt.question)
        result = await asyncio.wait_for(running, agent.episode_timeout)
        return result, None, time.monotonic() - start
    except asyncio.TimeoutError:
        return None, f"TimeoutError: the episode ran over {agent.episode_timeout:g} s", time.monotonic() - start
    except Exception as e:  # noqa: BLE001 - whatever the agent raises becomes an error row
        return None, f"{type(e).__name__}: {e}"[:2000], time.monotonic() - start
    finally:
        await client.close()


def _fields(log: EpisodeLog, prompt: Prompt, result: Any, error: str | None,
            mark: ContentMarker | None = None) -> dict[str, Any]:
    """The rollout fields an episode determines: tokens from the recording, messages and metadata
    from the agent's result (see tasks/agent.py; images in them through `mark`, the service's)."""
    t = assemble(log)
    if error is not None:
        # No tokens: an agent's failure is not evidence about the policy's tokens; the row is scored
        # (errors are data) and takes part in its group's baseline, but trains nothing.
        return dict(messages=t.messages, token_ids=[], loss_mask=[], behavior_logprobs=[], segment_starts=[],
                    num_turns=t.num_turns, num_tool_calls=_tool_messages(t.messages), finish_reason="error",
                    truncated=False, metadata={**prompt.metadata, "error": error})
    extra: dict[str, Any] = {}
    messages, note = t.messages, None
    if result is not None and not isinstance(result, (list, dict)) and framework_of(result) is not None:
        result = {"messages": result}  # a framework's result object (an Agents SDK RunResult, a smolagents agent)
    if isinstance(result, list):
        messages, note = _returned(result, log, t.messages, mark)
    elif isinstance(result, dict):
        if result.get("messages") is not None:
            messages, note = _returned(result["messages"], log, t.messages, mark)
        extra = result.get("metadata") or {}
        if not isinstance(extra, dict):
            raise TypeError("the result's 'metadata' must be a dict")
        clash = sorted(set(extra) & set(prompt.metadata))
        if clash:
            raise ValueError(f"the result's metadata would overwrite the prompt's ground truth fields {clash}")
    elif result is not None:
        raise TypeError(f"rollout returned a {type(result).__name__}; expected a dict, a list of messages, a framework's "
                        "result object or None")
    if note is not None:
        extra = {**extra, "messages_note": note}
    last = next((m for m in reversed(messages) if m.role == "assistant"), None)
    return dict(messages=messages, token_ids=t.token_ids, loss_mask=t.loss_mask, behavior_logprobs=t.behavior_logprobs,
                segment_starts=t.segment_starts, image_ids=t.image_ids, num_turns=t.num_turns,
                num_tool_calls=_tool_messages(messages),
                finish_reason="answer" if last is not None and not last.tool_calls else "max_turns",
                truncated=t.finish_reason == "length", metadata={**prompt.metadata, **extra, **_constrained(t)})


def _constrained(t: Any) -> dict[str, Any]:
    """`served_constraints` (per call, the constraint its turn was sampled under, null when free) when any call
    was constrained: those turns' behaviour log-probs are the masked distribution's (README, service)."""
    return {"served_constraints": t.constraints} if any(t.constraints) else {}


def _returned(raw: Any, log: EpisodeLog, recorded: list[Message],
              mark: ContentMarker | None = None) -> tuple[list[Message], str | None]:
    """The agent's returned conversation (chat dicts, message objects or a framework's history, see
    tasks/histories.py) as records, and None; or, when it cannot be read, the recorded conversation and
    a note saying why (the episode's tokens stand either way, so it is no error row). A framework keeps
    its system prompt outside its history (LangGraph, the Agents SDK): the recorded one is put back."""
    try:
        messages = _messages(to_chat_messages(raw), log, mark)
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # Unconvertible and schema errors are ValueErrors
        return recorded, f"the returned messages could not be stored ({type(e).__name__}: {str(e)[:500]}); " \
                         "the recorded conversation stands"
    if is_framework_history(raw) and recorded and recorded[0].role == "system" and \
            (not messages or messages[0].role != "system"):
        messages = [recorded[0]] + messages
    return messages, None


def _messages(raw: list[Any], log: EpisodeLog, mark: ContentMarker | None = None) -> list[Message]:
    """The agent's conversation as records; a generated assistant message is stored as the model
    wrote it (its raw text, what the tokens hold), like the built-in loop stores it."""
    out = []
    for m in raw:
        data = m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else m
        message = ChatMessage.model_validate(data).to_message(mark)
        hit = log.returned.get(fingerprint(message.content, message.tool_calls)) if message.role == "assistant" else None
        out.append(log.calls[hit[0]].choices[hit[1]].message if hit else message)
    return out


def _tool_messages(messages: list[Message]) -> int:
    return sum(m.role == "tool" for m in messages)
