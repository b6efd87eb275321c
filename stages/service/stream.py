"""Streaming for the policy service: Server-Sent Events, tokens fed from the batcher thread, and what
part of a turn's text is already certain.

Tokens reach a streamed request as the batched `generate` samples them: the batcher thread hands each
decoding step to the request's `TokenFeed` (an asyncio queue, filled thread-safely), and the request's
event generator decodes each choice's tokens so far (`ChoiceText`) and sends what is *settled*: the part
of the content that no later token can change (`settled`). What is held back: a suffix that could still
become a stop string or the `<tool_call>` tag, an incomplete UTF-8 character, trailing whitespace when
tools are offered (the non-streamed content is stripped), and everything from a `<tool_call>` tag on.
At the end of the turn the rest of the content (text after a closed tool call, the held-back tail) and
the parsed tool calls follow, so the content deltas concatenate to exactly the content the non-streamed
response returns for the same tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

from stages.policy.sampling import decode_turn
from stages.service.schemas import error_body, visible_text
from tasks.base import OPEN_TAG

DONE = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    """One Server-Sent Event carrying a JSON object."""
    return f"data: {json.dumps(obj)}\n\n"


def _partial_suffix(text: str, markers: Sequence[str]) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


def settled(text: str, stops: Sequence[str], tools: bool) -> str:
    """The prefix of a turn's final content that no continuation of `text` (the turn's text so far)
    can change. Without tools the content is the text cut at the first stop string; with tools it is
    the text outside `<tool_call>` blocks, stripped (stages.service.schemas.without_tool_calls), whose
    certain part is the stripped text before the first tag."""
    text = text.rstrip("\ufffd")  # a multi-byte character whose last bytes are not sampled yet
    cut = visible_text(text, list(stops))
    markers = list(stops) + ([OPEN_TAG] if tools else [])
    if len(cut) == len(text):  # no stop string yet: one may still be forming at the end
        cut = cut[: len(cut) - _partial_suffix(cut, markers)]
    if not tools:
        return cut
    return cut.split(OPEN_TAG, 1)[0].strip()


class ChoiceText:
    """One streamed choice: the tokens sampled so far and the content already sent."""

    def __init__(self, max_new_tokens: int, eos_ids: set[int]) -> None:
        self.max_new_tokens, self.eos_ids = max_new_tokens, eos_ids
        self.tokens: list[int] = []
        self.sent = ""
        self.finished = False

    def add(self, token: int) -> bool:
        """Take one decoding step's token; False once the choice has ended (EOS, its own max_tokens:
        the batch may generate further for other requests)."""
        if self.finished or len(self.tokens) >= self.max_new_tokens:
            return False
        self.tokens.append(token)
        self.finished = token in self.eos_ids
        return True

    def delta(self, tokenizer: Any, stops: Sequence[str], tools: bool) -> str:
        """New settled content since the last call ("" when nothing new is certain)."""
        now = settled(decode_turn(tokenizer, self.tokens, self.eos_ids), stops, tools)
        if len(now) <= len(self.sent) or not now.startswith(self.sent):
            return ""
        out, self.sent = now[len(self.sent):], now
        return out

    def rest(self, content: str | None) -> str:
        """What remains to send of the final content (the turn is complete)."""
        content = content or ""
        return content[len(self.sent):] if content.startswith(self.sent) else ""


class TokenFeed:
    """Decoding steps of one request, from the batcher thread to the request's event generator."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._steps: asyncio.Queue[list[tuple[int, int]] | None] = asyncio.Queue()

    def on_step(self, tokens: list[tuple[int, int]]) -> None:
        """(choice index, token) pairs of one decoding step; called in the batcher thread."""
        self._loop.call_soon_threadsafe(self._steps.put_nowait, tokens)

    def watch(self, future: Future) -> None:
        """End the feed when the request's generation ends (its steps are all queued before)."""
        future.add_done_callback(lambda _: self._loop.call_soon_threadsafe(self._steps.put_nowait, None))

    async def steps(self) -> AsyncIterator[list[tuple[int, int]]]:
        """The decoding steps, until the generation has ended."""
        while (step := await self._steps.get()) is not None:
            yield step


def _chunker(rid: str, obj: str, model: str) -> Callable[..., str]:
    """`chunk(choices, **extra)`: one chunk event of a response (`obj`: its OpenAI object type)."""
    created = int(time.time())

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return sse({"id": rid, "object": obj, "created": created, "model": model, "choices": choices} | extra)

    return chunk


async def _events_sse(events: AsyncIterator[tuple], *, opening: list[str], text: Callable[[int, str], str],
                      finish: Callable[[dict[str, Any], str], Iterator[str]], chunk: Callable[..., str],
                      include_usage: bool) -> AsyncIterator[str]:
    """The one loop from PolicyService's events to SSE lines, for both endpoints: `opening`, then
    `text(index, delta)` per text event; an error event ends the stream with an error body; the done
    event gives `finish(choice, rest)` per choice, the usage chunk when asked, and `[DONE]`."""
    for line in opening:
        yield line
    async for event in events:
        if event[0] == "text":
            yield text(event[1], event[2])
        elif event[0] == "error":
            yield sse(error_body(event[1], "server_error"))
            return
        else:
            _, choices, rests, usage = event
            for c, rest in zip(choices, rests):
                for line in finish(c, rest):
                    yield line
            if include_usage:
                yield chunk([], usage=usage)
            yield DONE


def chat_sse(rid: str, model: str, n: int, include_usage: bool, events: AsyncIterator[tuple]) -> AsyncIterator[str]:
    """A chat completion's events (PolicyService.chat_deltas) in OpenAI's chunk format: the role delta
    per choice, content deltas, then per choice the rest of its content, its tool calls (`index` on
    each fragment; `id`, `type` and `name` in the first only), its finish chunk (`delta: {}`, the
    log-probs whole when asked); the usage chunk (`choices: []`) when asked; `[DONE]`."""
    chunk = _chunker(rid, "chat.completion.chunk", model)

    def delta(i: int, d: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> str:
        return chunk([{"index": i, "delta": d, "logprobs": logprobs, "finish_reason": finish}])

    def finish(c: dict[str, Any], rest: str) -> Iterator[str]:
        i, message = c["index"], c["message"]
        if rest:
            yield delta(i, {"content": rest})
        for k, call in enumerate(message.get("tool_calls", [])):
            yield delta(i, {"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                            "function": {"name": call["function"]["name"], "arguments": ""}}]})
            yield delta(i, {"tool_calls": [{"index": k, "function": {"arguments": call["function"]["arguments"]}}]})
        yield delta(i, {}, c["finish_reason"], c["logprobs"])

    return _events_sse(events, opening=[delta(i, {"role": "assistant", "content": "", "refusal": None}) for i in range(n)],
                       text=lambda i, t: delta(i, {"content": t}), finish=finish, chunk=chunk, include_usage=include_usage)


def completion_sse(rid: str, model: str, include_usage: bool, events: AsyncIterator[tuple]) -> AsyncIterator[str]:
    """A completion's events in OpenAI's `text_completion` chunk format: text deltas per choice, each
    choice's last chunk (the rest of its text, `finish_reason`, its log-probs when asked), the usage
    chunk (`choices: []`) when asked, `[DONE]`."""
    chunk = _chunker(rid, "text_completion", model)

    def text(i: int, t: str, finish: str | None = None, logprobs: Any = None) -> str:
        return chunk([{"index": i, "text": t, "logprobs": logprobs, "finish_reason": finish}])

    return _events_sse(events, opening=[], text=text, chunk=chunk, include_usage=include_usage,
                       finish=lambda c, rest: iter([text(c["index"], rest, c["finish_reason"], c["logprobs"])]))
