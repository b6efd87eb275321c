"""Environments written for `verifiers` (prime-rl's and the Environments Hub's standard), trained unchanged.

    task:
      name: verifiers
      params:
        env: examples/verifiers_guess/guess_env.py   # a file, or an installed module (`my_env`, `owner/my-env`)
        env_args: {max_turns: 4}                     # load_environment's keyword arguments
        episode_timeout: 60                          # seconds per episode: a hung environment is an error row
    score:
      rewards:
        - {fn: rewards.verifiers.functions}          # each rubric function a reward (or rewards.verifiers.rubric)

The environment's dataset and eval dataset are the task's "train" and "test" prompts (no eval dataset: the
train rows, as verifiers itself falls back), one prompt per row, id `vf-<split>-<example_id>`; the row's
`prompt` messages, `answer`, `info`, `task` (if any) and its other columns are kept in the prompt's metadata
(`vf`), `answer` also at the top (the built-in rewards read it there). Each episode is the environment's own
`rollout` (SingleTurnEnv, MultiTurnEnv's `env_response`/stop conditions, ToolEnv, StatefulToolEnv) with a
verifiers client on the run's policy service (stages/service), which records every call token-exactly; the
final conversation is the prompt plus the state's `completion` (tool results and the environment's turns are
not trained on).
The state's JSON-able fields the environment set (a game's secret, a counter) are kept in the rollout's
metadata (`vf_state`) for the rubric's functions at score time (rewards/verifiers.py), with the stop
condition and the number of turns.

Faults are error rows naming the environment, the episode and the turn, and the run goes on: an error the
environment raises or records (`state["error"]`; but a reply verifiers cannot read, empty or unparseable, is the
policy's outcome: the episode ends there and is scored, `vf_stop: invalid_model_response`), messages that do not
validate, and an episode over
`episode_timeout` (the environment's own `timeout_seconds` too). Each episode runs its own event loop in a
thread of its own, so even an environment that blocks (a `time.sleep` in `env_response`) cannot stop the
others: the thread is abandoned at the timeout.

The rollout batch id covers the installed verifiers' version, `env` and `env_args`, the environment's code
(its module's source without the rubric's reward functions, so editing a reward rescores stored rollouts and
editing the environment regenerates them; an installed module is versioned by its distribution's version),
and the dataset rows.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import linecache
import threading
from importlib import metadata as importlib_metadata
from typing import Any

from storage.ids import canonical_json
from storage.verifiers_env import env_module, is_file, load_env, quiet_datasets, rubric_functions
from tasks.agent import Endpoint
from tasks.base import AgentSpec, Prompt, Task

STATE_SKIP = {"prompt", "completion", "input", "task", "client", "model", "sampling_args", "trajectory", "timing",
              "tool_defs", "usage", "usage_tracker", "reward", "metrics", "error", "final_env_response", "responses",
              "trajectory_id", "answer", "info", "example_id", "advantage", "oai_tools"}


class EnvError(RuntimeError):
    """The environment failed (not the policy): the message names the environment, the episode and the turn."""


def verifiers_version() -> str:
    """The installed verifiers release."""
    return importlib_metadata.version("verifiers")


def jsonable(value: Any) -> Any:
    """`value` as plain JSON values (pydantic models dumped, tuples listed), or raise TypeError."""
    if hasattr(value, "model_dump"):
        value = value.model_dump(exclude_none=True)
    return json.loads(json.dumps(value, default=_default))


def _default(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_none=True)
    if isinstance(value, (set, tuple)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def row_prompt(split: str, row: dict[str, Any], identity: dict[str, Any]) -> Prompt:
    """One dataset row as a prompt: id from its example_id, the question its last user message's text."""
    messages = jsonable(row["prompt"])
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    user = next((m for m in reversed(messages) if m.get("role") == "user"), {"content": ""})
    content = user.get("content")
    question = content if isinstance(content, str) else json.dumps(content)
    info = row.get("info") or {}
    if isinstance(info, str):
        info = json.loads(info) if info.strip() else {}
    vf = {"prompt": messages, "answer": jsonable(row.get("answer", "")), "info": jsonable(info),
          "example_id": jsonable(row.get("example_id"))}
    if row.get("task") is not None:
        vf["task"] = jsonable(row["task"])
    # The row's other columns: verifiers passes them to the rubric's functions by name, and so does rlops.
    vf["columns"] = {k: jsonable(v) for k, v in row.items()
                     if k not in ("prompt", "answer", "info", "task", "example_id")}
    return Prompt(f"vf-{split}-{row.get('example_id')}", question,
                  {"answer": vf["answer"], "vf": vf, "env": identity})


def code_fingerprint(env: str, instance: Any) -> str:
    """The environment's code as far as it decides episodes: a file's (or installed module's) source with the
    rubric's reward functions cut out (their edits rescore, not regenerate); an installed distribution adds its
    version. The environment's settings (max_turns, timeouts, tools, sampling args) are in `settings`."""
    module = env_module(env)
    linecache.checkcache(getattr(module, "__file__", None) or "")  # the file as it is now, not as first read
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        source = ""
    for fn, _, _ in rubric_functions(instance.rubric):
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        if code is not None and code.co_filename == getattr(module, "__file__", None):
            try:
                source = source.replace(inspect.getsource(fn), "")
            except (OSError, TypeError):
                pass
    dist = None
    if not is_file(env):
        try:
            dist = importlib_metadata.version(module.__name__.split(".")[0].replace("_", "-"))
        except importlib_metadata.PackageNotFoundError:
            dist = None
    return hashlib.sha256(canonical_json({"source": source, "dist": dist}).encode()).hexdigest()[:16]


def settings(instance: Any) -> dict[str, Any]:
    """The environment's plain settings (its class, max_turns, timeouts, system prompt, tool definitions, sampling
    args): what changes its episodes besides its code."""
    out: dict[str, Any] = {"class": f"{type(instance).__module__}.{type(instance).__qualname__}"}
    for key, value in sorted(vars(instance).items()):
        if key.startswith("_") or key in ("dataset", "eval_dataset", "logger", "rubric", "env_id", "env_args"):
            continue
        if value is None or isinstance(value, (bool, int, float, str)):
            out[key] = value
    try:
        out["tool_defs"] = jsonable(getattr(instance, "tool_defs", None))
        out["sampling_args"] = jsonable(getattr(instance, "sampling_args", None))
    except TypeError:
        pass
    return out


def make_task(env: str, env_args: dict[str, Any] | None = None, name: str = "verifiers",
              max_error_frac: float = 0.25, episode_timeout: float = 120.0) -> Task:
    """The `Task` of a verifiers environment (module docstring). ValueError when the environment cannot be
    loaded, has no dataset, or its rows cannot be stored."""
    if episode_timeout <= 0:
        raise ValueError(f"task.params.episode_timeout must be > 0, got {episode_timeout}")
    instance = load_env(env, env_args)
    env_timeout = getattr(instance, "timeout_seconds", None)
    timeout = min(episode_timeout, env_timeout) if env_timeout else episode_timeout
    identity = {"verifiers": verifiers_version(), "env": env, "env_args": env_args or {},
                "code": code_fingerprint(env, instance), "settings": settings(instance)}
    try:
        with quiet_datasets():  # verifiers formats the rows with Dataset.map
            train = instance.get_dataset()
    except ValueError as e:
        raise ValueError(f"the verifiers environment {env!r} has no dataset: {e}") from e
    with quiet_datasets():
        test = instance.get_eval_dataset()
    splits: dict[str, list[Prompt]] = {}
    rows_hash = hashlib.sha256()
    for split, dataset in (("train", train), ("test", test)):
        try:
            splits[split] = [row_prompt(split, dict(row), identity) for row in dataset]
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"{env!r}: a {split} row cannot be stored as a prompt ({type(e).__name__}: {e}); "
                             "its prompt, answer and info must be JSON values") from e
        for p in splits[split]:
            rows_hash.update(canonical_json([p.prompt_id, p.metadata["vf"]]).encode())
    label = f"verifiers {env}"

    async def episode(endpoint: Endpoint, prompt: Prompt) -> dict[str, Any]:
        return await play(instance, label, endpoint, prompt, timeout)

    version = hashlib.sha256(canonical_json({"identity": identity, "rows": rows_hash.hexdigest()}).encode()
                             ).hexdigest()[:16]
    # The stage's own timeout is a backstop a little past the episode's: `play` reports the turn first.
    agent = AgentSpec(entry=f"verifiers:{env}", fn=episode, version=version, max_error_frac=max_error_frac,
                      episode_timeout=timeout + 10.0, form="prompt")
    return Task(name=name, system_prompt="", prompts=lambda split: list(splits.get(split, [])),
                max_turns=max(int(getattr(instance, "max_turns", 1) or 1), 1), agent=agent)


async def play(instance: Any, label: str, endpoint: Endpoint, prompt: Prompt, timeout: float) -> dict[str, Any]:
    """One episode of `prompt`'s row: the environment's `rollout` in a thread and event loop of its own, waited
    for at most `timeout` s; the conversation and {vf_state, vf_stop, vf_turns} metadata, or an EnvError."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()
    turns = [0]

    def settle(outcome: tuple[str, Any]) -> None:
        if not done.done():
            done.set_result(outcome)

    def run() -> None:
        try:
            outcome = ("ok", asyncio.run(_rollout(instance, endpoint, prompt, turns)))
        except BaseException as e:  # noqa: BLE001 - the environment's failure is the episode's error row
            outcome = ("error", e)
        loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=run, name=f"rlops-vf-{endpoint.episode_id}", daemon=True).start()
    where = f"{label}, episode {endpoint.episode_id} ({prompt.prompt_id})"
    try:
        kind, value = await asyncio.wait_for(done, timeout)
    except asyncio.TimeoutError:
        raise EnvError(f"{where}: ran over {timeout:g} s at turn {turns[0] + 1} (after {turns[0]} model "
                       "call(s)); the episode's thread is abandoned") from None
    if kind == "error":
        raise EnvError(f"{where}, turn {turns[0]}: {type(value).__name__}: {value}"[:2000]) from value
    state = value
    error = state.get("error")
    if _policy_fault(error):
        # The policy's reply could not be read (empty, unparseable): the policy's outcome, not the environment's
        # failure; the episode ends there, the service's record of it stands, and the rubric scores it.
        return {"metadata": {"vf_state": _state_fields(state, prompt), "vf_stop": "invalid_model_response",
                             "vf_turns": turns[0], "vf_model_error": f"{type(error).__name__}: {error}"[:500]}}
    if error is not None:
        raise EnvError(f"{where}, turn {turns[0]}: {type(error).__name__}: {error}"[:2000])
    if state.get("timed_out"):
        raise EnvError(f"{where}: the environment's timeout_seconds ran out at turn {turns[0]}")
    messages = jsonable(list(state["prompt"]) + list(state.get("completion") or []))
    return {"messages": messages, "metadata": {"vf_state": _state_fields(state, prompt),
                                               "vf_stop": state.get("stop_condition"),
                                               "vf_turns": len(state.get("trajectory") or [])}}


def _policy_fault(error: Any) -> bool:
    from verifiers.errors import InvalidModelResponseError

    return isinstance(error, InvalidModelResponseError)


def _state_fields(state: Any, prompt: Prompt) -> dict[str, Any]:
    """The state's JSON-able fields the environment set (STATE_SKIP: verifiers' own bookkeeping)."""
    extra = {}
    for key, item in state.items():
        if key in STATE_SKIP or key in prompt.metadata:
            continue
        try:
            extra[key] = jsonable(item)
        except TypeError:
            continue  # a live object (a sandbox, a client) is the episode's, not data
    return extra


async def _rollout(instance: Any, endpoint: Endpoint, prompt: Prompt, turns: list[int]) -> Any:
    """The environment's own rollout loop against the policy service (a verifiers client whose calls are counted)."""
    from verifiers.clients.openai_chat_completions_client import OpenAIChatCompletionsClient

    class Counted(OpenAIChatCompletionsClient):
        async def get_response(self, *args: Any, **kwargs: Any) -> Any:
            turns[0] += 1
            return await super().get_response(*args, **kwargs)

    openai_client = endpoint.async_client()
    vf = prompt.metadata["vf"]
    row = {**vf.get("columns", {}), **{k: vf[k] for k in ("prompt", "answer", "info", "example_id", "task") if k in vf}}
    try:
        return await instance.rollout(row, Counted(openai_client), endpoint.model, {})
    finally:
        await openai_client.close()
