"""Token-exact recording of an episode served over an OpenAI-compatible API.

An external agent sends whole conversations, as text, on every call. To train on what the policy
really did, the policy service (stages/service/service.py) records per call and episode id:

    prompt ids    the tokens the model was given (built below)
    sampled ids   what it sampled, EOS included, with the behaviour log-prob of each token

and builds every prompt so that an assistant message it generated earlier in the episode is its
recorded sampled tokens, never a re-tokenization of its text (which can split differently, and
whose text the client may have changed: tool calls come back as structured `tool_calls`, a stop
string is cut off). The template text around it is found as in the built-in loop
(`stages.policy.chat.ChatFormat`): render before and after, encode the difference.

`assemble` turns the calls of an episode into one rollout: each call's prompt either extends the
previous prompt + completion token for token (the new tokens are template/tool text, mask 0), or
it does not (the agent rewrote its history, or the template is not prefix-preserving) and starts a
new segment holding that whole prompt (mask 0). Every sampled token appears once with mask 1.
"""

from __future__ import annotations

import ast
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from stages.policy.chat import ChatFormat, difference
from storage.schema import Message, ToolCall
from tasks.base import OPEN_TAG


@dataclass
class Completion:
    """One sampled choice of one call."""

    prompt_ids: list[int]
    token_ids: list[int]  # sampled, EOS included when the model emitted it
    logprobs: list[float]  # aligned with token_ids
    message: Message  # content: the raw sampled text (renders back to token_ids), tool calls parsed
    finish_reason: str  # stop | length
    # The constraint the turn was sampled under (e.g. "tool_choice=required"), None when free: its
    # log-probs are then those of the masked, renormalised distribution (stages/policy/constrain.py).
    constraint: str | None = None
    # A vision-language policy's: the ids of the images whose placeholders prompt_ids holds, in placeholder order.
    image_ids: list[str] = field(default_factory=list)


@dataclass
class Call:
    """One chat/completions request of an episode and its n choices."""

    messages: list[Message]  # the conversation as the model saw it (generated turns as raw text)
    choices: list[Completion]
    chosen: int = 0  # the choice a later call continued; 0 when none did


def fingerprint(content: str | None, tool_calls: list[ToolCall]) -> str:
    """What an assistant message the service returned *means*, so that it is recognised however a
    client sends it back: tool calls by id, name and parsed arguments (pydantic-ai re-serialises
    them compactly, LangChain with `ensure_ascii=False`; pydantic-ai wraps malformed ones as
    `{"INVALID_JSON": raw}`), `content` None, "" and omitted alike (text parts arrive joined, extra
    keys such as `annotations` or `index` are dropped by the request schema). A changed text or
    call is a different meaning: the turn really changed."""
    calls = [[c.id, c.name, _arguments_meaning(c.arguments)] for c in tool_calls]
    return json.dumps([content or "", calls], sort_keys=True)


def _arguments_meaning(arguments: str) -> list:
    try:
        value = json.loads(arguments)
    except (json.JSONDecodeError, TypeError):
        return ["raw", arguments]
    if isinstance(value, dict) and list(value) == ["INVALID_JSON"] and isinstance(value["INVALID_JSON"], str):
        return _arguments_meaning(value["INVALID_JSON"])  # pydantic-ai's wrapping of arguments it cannot parse
    return ["json", value]


# smolagents sends the service's tool-call turn back as text: its own content (if any), then
# "Calling tools:\n" and the Python repr of [{"id", "type", "function": {"name", "arguments"}}]
# (smolagents/memory.py ActionStep.to_messages); the tool's result follows as a user "Observation:".
_SMOLAGENTS_CALLS = re.compile(r"(?P<text>.*?)\n?Calling tools:\n(?P<calls>\[.*\])\s*", re.DOTALL)


def text_echo_fingerprint(content: str | None) -> str | None:
    """The fingerprint of an assistant turn that a framework flattened into text (smolagents), or None
    when `content` is not such a text. The calls keep the service's ids, so only the service's own
    turn can match; arguments compare by meaning, as in `fingerprint`."""
    match = _SMOLAGENTS_CALLS.fullmatch(content or "")
    if match is None:
        return None
    try:
        listed = ast.literal_eval(match["calls"])  # literals only: never evaluates code
        calls = [ToolCall(c["id"], c["function"]["name"], a if isinstance(a := c["function"]["arguments"], str)
                          else json.dumps(a)) for c in listed]
    except (ValueError, SyntaxError, TypeError, KeyError, MemoryError, RecursionError):
        return None
    return fingerprint(match["text"].strip() or None, calls)


def as_written(message: Message) -> Message:
    """An assistant message the service does not recognise (edited, or not its own), as the model
    would have written it: its text followed by its tool calls in the `<tool_call>{json}</tool_call>`
    format of tasks/base.py, so a new segment keeps the calls instead of rendering the text alone."""
    if not message.tool_calls:
        return message
    blocks = []
    for c in message.tool_calls:
        meaning = _arguments_meaning(c.arguments)
        if meaning[0] == "json":
            blocks.append(f"{OPEN_TAG}{json.dumps({'name': c.name, 'arguments': meaning[1]})}</tool_call>")
        else:  # malformed arguments stay as the text they are
            blocks.append(f'{OPEN_TAG}{{"name": {json.dumps(c.name)}, "arguments": {meaning[1]}}}</tool_call>')
    text = "\n".join(([message.content] if message.content else []) + blocks)
    return replace(message, content=text)


@dataclass
class EpisodeLog:
    """Every call of one episode, in arrival order."""

    calls: list[Call] = field(default_factory=list)
    returned: dict[str, tuple[int, int]] = field(default_factory=dict)  # fingerprint -> (call, choice)

    def add(self, call: Call, returned: list[Message]) -> None:
        """Record a call; `returned[i]` is choice i's message exactly as the response carries it."""
        self.calls.append(call)
        for i, m in enumerate(returned):
            self.returned[fingerprint(m.content, m.tool_calls)] = (len(self.calls) - 1, i)


class Recorder:
    """Episode id -> EpisodeLog, thread-safe; the oldest episodes are dropped past `max_episodes`
    (a long-running `rlops serve` must not grow without bound; the rollout stage pops its own)."""

    def __init__(self, max_episodes: int = 10_000) -> None:
        self.max_episodes = max_episodes
        self._episodes: OrderedDict[str, EpisodeLog] = OrderedDict()
        self._lock = threading.Lock()
        # Requests that generated but could not be filed under an episode: why an episode recorded
        # nothing (`why_empty`). Counted over the recorder's life, i.e. one rollout shard.
        self.without_episode = 0
        self.unknown_models: dict[str, int] = {}

    def count_unrecorded(self, *, unknown_model: str | None = None) -> None:
        """Count a request that came without an episode id, or (`unknown_model`) named no served model."""
        with self._lock:
            if unknown_model is None:
                self.without_episode += 1
            else:
                self.unknown_models[unknown_model] = self.unknown_models.get(unknown_model, 0) + 1

    def why_empty(self, served: str) -> str:
        """Why an episode has no recorded call, as precisely as this shard's stray requests tell:
        the error text of its row (an empty episode is never an 'answer')."""
        reasons = []
        if self.without_episode:
            reasons.append(f"{self.without_episode} request(s) came without an episode id (send the X-Episode-Id "
                           "header, or use the /ep/{episode_id}/v1 base URL the agent is given)")
        for name, n in sorted(self.unknown_models.items()):
            reasons.append(f"{n} request(s) named an unknown model {name!r} (this rollout serves {served!r}: pass "
                           "the `model` the agent is given)")
        why = "; during this shard " + "; ".join(reasons) if reasons else \
            "; no request of this shard came without an episode id or named an unknown model (did the agent call the model?)"
        return "the agent made no call recorded under this episode" + why

    def get(self, episode_id: str) -> EpisodeLog:
        with self._lock:
            log = self._episodes.get(episode_id)
            if log is None:
                log = self._episodes[episode_id] = EpisodeLog()
                while len(self._episodes) > self.max_episodes:
                    self._episodes.popitem(last=False)
            return log

    def peek(self, episode_id: str) -> EpisodeLog | None:
        with self._lock:
            return self._episodes.get(episode_id)

    def pop(self, episode_id: str) -> EpisodeLog | None:
        with self._lock:
            return self._episodes.pop(episode_id, None)


def chat_prompt(chat: ChatFormat, messages: list[Message], log: EpisodeLog | None,
                eos_ids: set[int]) -> tuple[list[int], list[Message]]:
    """Prompt ids for `messages` + the generation prompt, reusing the sampled tokens of every
    assistant message this episode's log recognises; also returns the conversation as the model
    saw it (recognised messages as their raw sampled text). Marks which choice each call continued."""
    reused: dict[int, Completion] = {}
    seen = list(messages)
    for k, m in enumerate(messages):
        hit = log.returned.get(fingerprint(m.content, m.tool_calls)) if log and m.role == "assistant" else None
        if hit is None and log and m.role == "assistant" and not m.tool_calls:
            hit = log.returned.get(text_echo_fingerprint(m.content) or "")
        if hit is not None:
            call, choice = hit
            log.calls[call].chosen = choice
            reused[k] = log.calls[call].choices[choice]
            seen[k] = reused[k].message
        elif m.role == "assistant":
            seen[k] = as_written(m)
    try:
        return _with_recorded(chat, seen, reused, eos_ids), seen
    except ValueError:
        # The template renders earlier messages differently once more are appended: the prompt is
        # its plain rendering, and `assemble` starts a new segment at this call.
        return chat.encode(chat.render(seen, True)), seen


def _with_recorded(chat: ChatFormat, messages: list[Message], reused: dict[int, Completion],
                   eos_ids: set[int]) -> list[int]:
    ids: list[int] = []
    done = ""  # the rendered text the ids cover so far
    for k in sorted(reused):
        turn = reused[k]
        before = chat.render(messages[:k], True)  # ... up to this turn's generation prompt
        ids += chat.encode(difference(done, before))
        ids += turn.token_ids
        after = chat.render(messages[: k + 1], False)
        end = difference(before + (turn.message.content or ""), after)
        if turn.token_ids and turn.token_ids[-1] in eos_ids:
            # The sampled EOS already is the start of the end-of-turn text (as in stages.policy.agent_loop.add_turn).
            eos_text = chat.tokenizer.decode(turn.token_ids[-1:], skip_special_tokens=False)
            end = end[len(eos_text):] if end.startswith(eos_text) else end
        ids += chat.encode(end) if end else []
        done = after
    rest = difference(done, chat.render(messages, True))
    return ids + (chat.encode(rest) if rest else [])


@dataclass
class Trajectory:
    """An episode's calls as one rollout's token fields (see `storage.schema.Rollout.segments`)."""

    token_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    segment_starts: list[int]
    messages: list[Message]  # the last call's conversation + its chosen completion
    num_turns: int
    finish_reason: str  # of the last completion: stop | length
    constraints: list[str | None] = field(default_factory=list)  # per call, its chosen completion's constraint
    image_ids: list[str] = field(default_factory=list)  # the images of token_ids' placeholders, in order (all segments)


def assemble(log: EpisodeLog) -> Trajectory:
    """One rollout from an episode's calls, each contributing its chosen completion."""
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    starts: list[int] = []
    images: list[str] = []
    segment, segment_images = 0, 0  # where the current segment starts in ids and in images
    for call in log.calls:
        turn = call.choices[call.chosen]
        current, seen = ids[segment:], images[segment_images:]
        # Equal placeholder tokens may stand for different images: the images must extend the segment's too.
        if current and turn.prompt_ids[: len(current)] == current and turn.image_ids[: len(seen)] == seen:
            new, new_images = turn.prompt_ids[len(current):], turn.image_ids[len(seen):]
        else:
            if ids:
                starts.append(len(ids))
                segment, segment_images = len(ids), len(images)
            new, new_images = turn.prompt_ids, turn.image_ids
        images += new_images
        ids += new + turn.token_ids
        mask += [0] * len(new) + [1] * len(turn.token_ids)
        logprobs += [0.0] * len(new) + turn.logprobs
    last = log.calls[-1] if log.calls else None
    return Trajectory(
        token_ids=ids, loss_mask=mask, behavior_logprobs=logprobs, segment_starts=starts,
        messages=(last.messages + [last.choices[last.chosen].message]) if last else [],
        num_turns=len(log.calls), finish_reason=last.choices[last.chosen].finish_reason if last else "",
        constraints=[c.choices[c.chosen].constraint for c in log.calls], image_ids=images,
    )
