"""The multi-turn agent loop, run over many episodes at once.

Each turn, all still-active episodes generate together (one batched `Backend.generate` call); the
tool calls they make are parsed with `tasks.base.parse_tool_calls` and run by the task's Python
tools in threads with a per-call timeout; the results are appended and the next turn starts.
An assistant turn without a tool call is the final answer. With a backend that offers
`conversation()` (the HF backend), each turn's key/value cache is kept for the next, so a turn
prefills only the tool results and the new generation prompt, not the whole conversation again.

Token ids are built incrementally, never by re-tokenizing the conversation afterwards:

    prompt      chat template of the opening messages + generation prompt     mask 0
    turn        the sampled tokens exactly as sampled (EOS included)          mask 1, log-probs
    end of turn the template's end-of-turn text not already sampled           mask 0
                (chatml: "\\n" after a sampled <|im_end|>, "<|im_end|>\\n" without one)
    tools       the template's tool messages + the next generation prompt     mask 0

so `tokenizer.decode(token_ids)` equals the chat template's rendering of the stored messages, and
the loss sees exactly the tokens the policy sampled (re-tokenizing their text could split it
differently). Each piece of template text is found generically by rendering the conversation
before and after the piece and taking the difference (`ChatFormat`).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

from stages.policy.chat import ChatFormat
from stages.policy.sampling import Backend, Sample, SamplingConfig, decode_turn
from storage.schema import Message, ToolCall
from tasks.base import Prompt, Task, parse_tool_calls


@dataclass(frozen=True)
class EpisodeSpec:
    """One episode to run: a task prompt and its seed (a GRPO group is G specs with one prompt)."""

    prompt: Prompt
    seed: int


@dataclass
class Episode:
    """What one episode produced: exactly the fields a `Rollout` row takes from the agent loop.

    `num_tool_calls` / `num_tool_errors` count the tool messages in `messages` (and those among
    them that report an error). `finish_reason` is "answer", "max_turns" (the last turn still
    called a tool; that call is not run) or "max_tokens" (the `max_total_tokens` budget ran out,
    mid-turn or because the next tool results did not fit, which are then dropped: `messages`
    hold exactly what the tokens hold). `truncated` is True when the last assistant turn was cut
    by a length limit (the budget, or `max_new_tokens` of a turn).
    `gen_seconds` is the wall time from the start of the batch until this episode finished.
    """

    messages: list[Message]
    token_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    num_turns: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    finish_reason: str = ""
    truncated: bool = False
    gen_seconds: float = 0.0
    image_ids: list[str] = field(default_factory=list)  # a visual episode's stored images (stages/policy/vlm_episodes.py)
    error: str | None = None  # why the episode failed (finish_reason "error"), naming the turn

    def fail(self, error: str) -> None:
        """End the episode as an error row (finish_reason "error"), as an external agent's failed episode is
        (stages/service/external.py): no tokens, since they are not what the policy was given; scored and part
        of its group's baseline, it trains nothing."""
        self.token_ids, self.loss_mask, self.behavior_logprobs = [], [], []
        self.error, self.finish_reason, self.truncated = error, "error", False

    def extend(self, ids: list[int], logprobs: list[float] | None = None) -> None:
        """Append tokens: sampled ones (with their log-probs, mask 1) or template text (mask 0)."""
        self.token_ids += ids
        self.loss_mask += [0 if logprobs is None else 1] * len(ids)
        self.behavior_logprobs += [0.0] * len(ids) if logprobs is None else logprobs


@dataclass
class ToolResult:
    content: str | list[dict[str, Any]]  # text, or OpenAI content parts as the tool returned them (an image view)
    error: bool


def call_tools(calls: list[ToolCall], tools: dict[str, Callable[..., str]], timeout: float) -> list[ToolResult]:
    """Run tool calls concurrently, waiting at most `timeout` seconds for all of them together.

    Every failure becomes an error message the model can react to, never an exception: a
    malformed call, an unknown tool, arguments that are not a JSON object, a tool that raises,
    a tool still running at the timeout.
    """
    started = [_start(call, tools) for call in calls]
    wait([f for f in started if isinstance(f, Future)], timeout=timeout)
    return [_result(call, f, timeout) for call, f in zip(calls, started)]


def _start(call: ToolCall, tools: dict[str, Callable[..., str]]) -> ToolResult | Future:
    if not call.name:
        return ToolResult(
            f"error: malformed tool call {call.arguments[:200]!r}; "
            'write <tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>',
            True,
        )
    if call.name not in tools:
        return ToolResult(f"error: unknown tool {call.name!r}; available: {', '.join(sorted(tools))}", True)
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError as e:
        return ToolResult(f"error: arguments of {call.name!r} are not valid JSON ({e})", True)
    if not isinstance(arguments, dict):
        return ToolResult(f"error: arguments of {call.name!r} must be a JSON object", True)

    future: Future = Future()
    fn = tools[call.name]

    def target() -> None:
        try:
            future.set_result(fn(**arguments))
        except BaseException as e:  # the tool's failure is reported to the model, not raised here
            future.set_exception(e)

    # One daemon thread per call: Python cannot kill a thread, so a hanging tool is abandoned after
    # the timeout, and as a daemon it does not keep the process alive at exit.
    threading.Thread(target=target, name=f"tool-{call.name}", daemon=True).start()
    return future


def _result(call: ToolCall, started: ToolResult | Future, timeout: float) -> ToolResult:
    if isinstance(started, ToolResult):
        return started
    if not started.done():
        return ToolResult(f"error: tool {call.name!r} timed out after {timeout:g} s", True)
    if (e := started.exception()) is not None:
        return ToolResult(f"error: tool {call.name!r} raised {type(e).__name__}: {e}", True)
    result = started.result()
    return ToolResult(result if isinstance(result, list) else str(result), False)


def run_episodes(
    backend: Backend,
    tokenizer: Any,
    task: Task,
    episodes: list[EpisodeSpec],
    sampling: SamplingConfig,
    max_total_tokens: int = 4096,
    tool_timeout: float = 10.0,
) -> list[Episode]:
    """Run the agent loop for all `episodes` together and return one `Episode` per spec, in order.

    `max_total_tokens` bounds each episode's whole token sequence (prompt, turns, tool results);
    `tool_timeout` bounds each turn's tool calls (seconds). A turn's batch seed is derived from
    `sampling.seed`, the active episodes' seeds and the turn, so a batch reruns identically.
    """
    start = time.monotonic()
    chat = ChatFormat(tokenizer)
    eos_ids: set[int] = backend.eos_ids
    out: list[Episode] = []
    for spec in episodes:
        opening = [Message(role=m["role"], content=m["content"]) for m in task.messages(spec.prompt)]
        out.append(Episode(messages=opening, token_ids=[], loss_mask=[], behavior_logprobs=[]))
        out[-1].extend(chat.encode(chat.render(opening, True)))
    # Room kept for the end-of-turn tokens, so that closing a turn never breaks the budget.
    reserve = len(chat.encode(chat.end_of_turn(out[0].messages, Message("assistant", "x")))) if out else 0

    def finish(i: int, reason: str, truncated: bool) -> None:
        out[i].finish_reason, out[i].truncated = reason, truncated
        out[i].gen_seconds = time.monotonic() - start

    # The HF backend keeps each turn's key/value cache for the next turn (`HFBackend.conversation`).
    with getattr(backend, "conversation", nullcontext)():
        active = list(range(len(out)))
        for turn in range(task.max_turns):
            room = {i: max_total_tokens - len(out[i].token_ids) - reserve for i in active}
            for i in active:
                if room[i] < 1:
                    finish(i, "max_tokens", True)
            active = [i for i in active if room[i] >= 1]
            if not active:
                break
            # One generate call for every active episode; each sample is cut to its own room after.
            turn_sampling = replace(sampling, max_new_tokens=min(sampling.max_new_tokens, max(room.values())))
            seed = turn_seed(sampling.seed, [episodes[i].seed for i in active], turn)
            samples = backend.generate([out[i].token_ids for i in active], turn_sampling, seed)

            calling: list[tuple[int, list[ToolCall]]] = []
            for i, sample in zip(active, samples):
                if sample.error is not None:  # e.g. vLLM ran other prompt ids than the recorded ones
                    out[i].fail(f"turn {turn + 1}: {sample.error}")
                    finish(i, "error", False)
                    continue
                calls, budget_hit, length_cut = add_turn(out[i], sample, room[i], turn, chat, eos_ids)
                if budget_hit:
                    finish(i, "max_tokens", True)
                elif not calls:
                    finish(i, "answer", length_cut)
                elif turn == task.max_turns - 1:
                    finish(i, "max_turns", length_cut)
                else:
                    calling.append((i, calls))

            results = iter(call_tools([c for _, calls in calling for c in calls], task.tools, tool_timeout))
            active = []
            for i, calls in calling:
                ep = out[i]
                done = [next(results) for _ in calls]
                tool_messages = [Message("tool", r.content, tool_call_id=c.id, name=c.name) for c, r in zip(calls, done)]
                if not add_tool_results(ep, chat, tool_messages, sum(r.error for r in done), max_total_tokens - reserve):
                    finish(i, "max_tokens", True)  # the results do not fit: the episode ends without them
                    continue
                active.append(i)
    return out


def add_tool_results(ep: Episode, chat: ChatFormat, results: list[Message], errors: int, budget: int) -> bool:
    """Append a turn's tool messages to `ep` (their template text and the next generation prompt, mask 0)
    when they fit in `budget` tokens with room for one sampled token; False, appending nothing, when they
    do not (the caller ends the episode)."""
    ids = chat.encode(chat.tool_turn(ep.messages, results))
    if len(ep.token_ids) + len(ids) + 1 > budget:
        return False
    ep.messages += results
    ep.extend(ids)
    ep.num_tool_calls += len(results)
    ep.num_tool_errors += errors
    return True


def add_turn(
    ep: Episode, sample: Sample, room: int, turn: int, chat: ChatFormat, eos_ids: set[int]
) -> tuple[list[ToolCall], bool, bool]:
    """Append one sampled turn (cut to `room` tokens) and its end-of-turn tokens to `ep`.

    Returns (tool calls in the turn, whether the token budget cut it, whether any length limit did).
    """
    ids, logprobs = sample.token_ids[:room], sample.logprobs[:room]
    budget_hit = len(sample.token_ids) > room or (sample.finish_reason == "length" and len(ids) == room)
    cut = len(ids) < len(sample.token_ids)
    text = decode_turn(chat.tokenizer, ids, eos_ids) if cut else sample.text
    calls = parse_tool_calls(text, turn)
    message = Message("assistant", text, tool_calls=calls)
    end = chat.end_of_turn(ep.messages, message)
    if ids and ids[-1] in eos_ids:
        # The sampled EOS is the start of the template's end-of-turn text; append only the rest.
        # (An EOS that is not, e.g. <|endoftext|> under chatml, stays in the tokens on top of the
        # template's full end-of-turn text: the one case where decode(token_ids) has extra text.)
        eos_text = chat.tokenizer.decode(ids[-1:], skip_special_tokens=False)
        end = end[len(eos_text) :] if end.startswith(eos_text) else end
    ep.messages.append(message)
    ep.extend(ids, logprobs)
    ep.extend(chat.encode(end) if end else [])
    ep.num_turns += 1
    return calls, budget_hit, budget_hit or sample.finish_reason == "length"


def turn_seed(base: int, seeds: list[int], turn: int) -> int:
    """A batch seed from the base seed, the active episodes' seeds and the turn (31 bits, which
    every backend accepts)."""
    digest = hashlib.sha256(f"{base}:{turn}:{seeds}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF
