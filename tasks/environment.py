"""Environments as tasks: the session protocol every environment source implements, and the driver
that plays one episode against the policy service.

An environment task (tasks/openenv.py, tasks/textarena.py) is an external agent task (tasks/agent.py)
whose agent is `drive`: the rollout stage runs it G times per prompt through the policy service
(stages/service/external.py: concurrency, timeouts, error rows, resume), so an environment episode
is recorded token-exactly like any other agent's, one segment when every turn extends the last.

One episode:

    session = open_session()                       # a session of its own (an OpenEnv WebSocket, a game)
    observation = session.reset(seed)              # the prompt: the user turn after the system prompt
    for turn in 1..max_turns:
        reply = policy(messages)                   # through the service, like any agent's call
        action = parse(reply)                      # a tool call of the Action's schema, or the plain text
        observation, reward, done = session.step(action)   # each within step_timeout_s
        messages += [reply, observation]           # the tool result (or a user turn in text mode)
        if done: break

A prompt is a seed: `Prompt("seed-17", ...)` with metadata {"seed": 17, "env": identity}; the G
episodes of a group reset with the same seed. Every step is stored in the rollout's metadata:

    metadata.env_steps = [{turn, action, observation, reward, done, error}, ...]
    metadata.env_end   = "done" | "max_turns"

and the `env` reward (rewards/builtin.py) sums them (or takes the last). An action that cannot be
parsed is no step: the model is told what is wrong (a step record with `error` and no reward) and
the turn counts. A failure of the environment itself (a dead server, a step over the timeout, an
observation that does not validate) raises `EnvError`, naming the environment, the episode and the
step: the rollout stage stores it as the episode's error row and goes on.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Awaitable, Callable, Literal, Protocol

from storage.ids import canonical_json
from tasks.agent import Endpoint
from tasks.base import AgentSpec, Prompt, Task

# Defaults shared by every environment source: disjoint seed ranges, [start, stop).
TRAIN_SEEDS = (0, 1000)  # the training split: 1000 episodes' worth of resets
EVAL_SEEDS = (1_000_000, 1_000_064)  # held out: far from any train range a user is likely to widen to


class EnvError(RuntimeError):
    """The environment failed (not the policy): the message names the environment, the episode and the step."""


@dataclass(frozen=True)
class StepOutcome:
    """What a reset or a step returns: the observation as the model will read it, the step's reward, done."""

    observation: str
    reward: float | None = None
    done: bool = False


class EnvSession(Protocol):
    """One episode's session with an environment; each method may raise (a dead server, a bad reply)."""

    async def reset(self, seed: int) -> StepOutcome: ...

    async def step(self, action: dict[str, Any]) -> StepOutcome: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class DriverConfig:
    """How `drive` plays an environment."""

    name: str  # the environment as errors name it: "openenv guess (http://127.0.0.1:8765)"
    system_prompt: str
    max_turns: int  # assistant turns (= steps) per episode
    action_schema: dict[str, Any]  # JSON schema of the Action (its `metadata` field left out)
    action: Literal["tool", "text"] = "tool"  # text: the reply's text is the Action's one string field
    tool_name: str = "act"
    # The environment's own tools (OpenEnv MCP tools, as OpenAI functions), offered instead of the one
    # action tool: a call of one is the action {"tool_name": name, "arguments": {...}}.
    tools: tuple[dict[str, Any], ...] = ()
    step_timeout_s: float = 30.0  # reset, step and session start each
    open_timeout_s: float | None = None  # session start, when it may (re)start a server: step_timeout_s if None
    # "required": the service constrains each turn to a valid call of the Action (stages/service/decoding.py),
    # so every turn is a step even for a small model; "auto": the model may answer without one.
    tool_choice: Literal["required", "auto"] = "required"

    @property
    def text_field(self) -> str:
        """The Action's one string field (text mode)."""
        return text_field(self.action_schema)

    def tool(self) -> dict[str, Any]:
        """The one tool the model acts through: the Action's schema as an OpenAI function."""
        return {"type": "function", "function": {"name": self.tool_name, "description": self.action_schema.get(
            "description", "Take your action in the environment."), "parameters": self.action_schema}}


def action_parameters(schema: dict[str, Any]) -> dict[str, Any]:
    """The Action's JSON schema as tool parameters: its `metadata` field (OpenEnv's bookkeeping, not
    the agent's to fill) left out."""
    properties = {k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}
    out = {**schema, "type": "object", "properties": properties,
           "required": [r for r in schema.get("required", []) if r in properties]}
    out.pop("title", None)
    return out


def text_field(schema: dict[str, Any]) -> str:
    """The name of an Action's one string field; ValueError when it has not exactly one field, a string."""
    properties = {k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}
    if len(properties) != 1 or next(iter(properties.values())).get("type") != "string":
        raise ValueError(f"action: text needs an Action with exactly one string field; this one has "
                         f"{ {k: v.get('type', '?') for k, v in properties.items()} }: use action: tool")
    return next(iter(properties))


@dataclass
class StepRecord:
    """One turn of an episode, as stored in metadata.env_steps."""

    turn: int
    action: str | None  # the action sent (JSON of the arguments, or the text); None when none could be parsed
    observation: str
    reward: float | None = None
    done: bool = False
    error: str | None = None  # why the reply was no action (then nothing was sent to the environment)


def seed_prompts(name: str, seeds: tuple[int, int], metadata: dict[str, Any]) -> list[Prompt]:
    """One prompt per seed in [start, stop): id "seed-N", metadata {"seed": N, **metadata}. The
    question is a placeholder for listings: the episode's real prompt is the reset's observation."""
    start, stop = seeds
    return [Prompt(f"seed-{s}", f"{name}: reset(seed={s})", {"seed": s, **metadata}) for s in range(start, stop)]


def check_seeds(train_seeds: list[int], eval_seeds: list[int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two [start, stop) ranges, checked: two ints each, non-empty, and disjoint (a held-out
    seed seen in training would make the eval split a training split)."""
    ranges = []
    for key, value in (("train_seeds", train_seeds), ("eval_seeds", eval_seeds)):
        if len(value) != 2 or value[0] >= value[1]:
            raise ValueError(f"task.params.{key}: a [start, stop) pair with start < stop, got {value}")
        ranges.append((value[0], value[1]))
    (a, b), (c, d) = ranges
    if a < d and c < b:
        raise ValueError(f"task.params.train_seeds {list(ranges[0])} and eval_seeds {list(ranges[1])} overlap: "
                         "the held-out split must not contain training seeds")
    return ranges[0], ranges[1]


def env_task(*, name: str, identity: dict[str, Any], config: DriverConfig, train_seeds: tuple[int, int],
             eval_seeds: tuple[int, int], open_session: Callable[[], Awaitable[EnvSession]],
             check_sessions: Callable[[int], None] | None = None, max_error_frac: float = 0.25,
             episode_timeout: float = 600.0) -> Task:
    """The `Task` of an environment: split "train" from `train_seeds`, "test" from `eval_seeds`, each
    prompt carrying `identity` (package and version, config, what the server reports) so it enters the
    rollout batch id and every row; episodes played by `drive` with sessions from `open_session`.
    `check_sessions(n)` raises ValueError when the environment cannot hold n concurrent sessions."""
    meta = {"env": identity}
    splits = {"train": seed_prompts(name, train_seeds, meta), "test": seed_prompts(name, eval_seeds, meta)}

    async def episode(endpoint: Endpoint, prompt: Prompt) -> dict[str, Any]:
        return await drive(endpoint, prompt, config=config, open_session=open_session)

    version = hashlib.sha256(canonical_json({"identity": identity, "driver": asdict(config)}).encode()).hexdigest()[:16]
    agent = AgentSpec(entry=f"environment:{name}", fn=episode, version=version, max_error_frac=max_error_frac,
                      episode_timeout=episode_timeout, form="prompt", check_sessions=check_sessions)
    return Task(name=name, system_prompt=config.system_prompt, prompts=lambda split: list(splits.get(split, [])),
                max_turns=config.max_turns, agent=agent)


async def drive(endpoint: Endpoint, prompt: Prompt, *, config: DriverConfig,
                open_session: Callable[[], Awaitable[EnvSession]]) -> dict[str, Any]:
    """Play one episode of `prompt`'s seed against the policy at `endpoint`; the result the rollout
    stage stores: the conversation and {env_steps, env_end} metadata (module docstring)."""
    seed = int(prompt.metadata["seed"])
    steps: list[StepRecord] = []

    def where(step: int) -> str:
        return f"environment {config.name}, episode {endpoint.episode_id} (seed {seed}), step {step}"

    session = await _bounded(open_session(), config.open_timeout_s or config.step_timeout_s,
                             lambda: f"{where(0)}: opening a session")
    client = endpoint.async_client()
    try:
        first = await _bounded(session.reset(seed), config.step_timeout_s, lambda: f"{where(0)}: reset")
        messages: list[dict[str, Any]] = [{"role": "system", "content": config.system_prompt},
                                          {"role": "user", "content": first.observation}]
        end = "max_turns"
        for turn in range(1, config.max_turns + 1):
            reply = await client.chat.completions.create(model=endpoint.model, messages=messages, **_request(config))
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            action, call_id, problem = parse_action(message, config)
            if problem is None:
                out = await _bounded(session.step(action), config.step_timeout_s, lambda: f"{where(turn)}: step")
                record = StepRecord(turn, _shown(action, config), out.observation, out.reward, out.done)
            else:
                record = StepRecord(turn, None, f"error: {problem}", error=problem)
            steps.append(record)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": record.observation} if call_id
                            else {"role": "user", "content": record.observation})
            if record.done:
                end = "done"
                break
    finally:
        await client.close()
        try:  # a session of a dead server cannot close cleanly; the episode's outcome stands
            await asyncio.wait_for(session.close(), config.step_timeout_s)
        except Exception:  # noqa: BLE001
            pass
    return {"messages": messages, "metadata": {"env_steps": [asdict(s) for s in steps], "env_end": end}}


def _request(config: DriverConfig) -> dict[str, Any]:
    """The chat request's extra fields: the action tool (tool mode)."""
    if config.action == "text":
        return {}
    return {"tools": list(config.tools) or [config.tool()], "tool_choice": config.tool_choice,
            "parallel_tool_calls": False}  # one action per turn


def parse_action(message: Any, config: DriverConfig) -> tuple[dict[str, Any], str | None, str | None]:
    """(action, tool call id or None, None) from an assistant reply, or ({}, call id, why it is no action)."""
    if config.action == "text":
        return {config.text_field: message.content or ""}, None, None
    names = [t["function"]["name"] for t in config.tools] or [config.tool_name]
    which = f"the {names[0]} tool" if len(names) == 1 else f"one of the tools {', '.join(names)}"
    calls = message.tool_calls or []
    if not calls:
        return {}, None, f"no action: call {which}"
    call = calls[0]
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError as e:
        return {}, call.id, f"the arguments are not JSON ({e})"
    if call.function.name not in names or not isinstance(arguments, dict):
        return {}, call.id, f"call {which} with a JSON object of its arguments"
    return ({"tool_name": call.function.name, "arguments": arguments} if config.tools else arguments), call.id, None


def _shown(action: dict[str, Any], config: DriverConfig) -> str:
    return action[config.text_field] if config.action == "text" else json.dumps(action, sort_keys=True)


async def _bounded(awaitable: Awaitable[Any], timeout: float, what: Callable[[], str]) -> Any:
    """`awaitable`'s result within `timeout` seconds; an EnvError saying `what()` and why otherwise."""
    try:
        return await asyncio.wait_for(awaitable, timeout)
    except asyncio.TimeoutError:
        raise EnvError(f"{what()}: no answer within step_timeout_s={timeout:g}") from None
    except EnvError:
        raise
    except Exception as e:  # noqa: BLE001 - a transport or protocol failure of the environment
        raise EnvError(f"{what()}: {type(e).__name__}: {e}") from e
