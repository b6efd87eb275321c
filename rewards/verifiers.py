"""A verifiers environment's rubric as rlops rewards: each function a named reward, or the rubric as one.

    score:
      rewards:
        - {fn: rewards.verifiers.functions}          # expanded: one reward per rubric function, its own weight
        # or the whole rubric, verifiers' weighted sum, each function's value in the details:
        - {name: rubric, fn: rewards.verifiers.rubric}

`functions` is expanded when a run config is read (flows/run_config.py, `expand`): a reward per function of
the environment's rubric (a RubricGroup's members flattened), named as verifiers names its metrics, weighted
as the rubric weights it; a metric (weight 0) is stored and audited but adds nothing to the total trained on.
An individual function is `rewards.verifiers.function` (per rollout), a group function (one taking `states`,
`completions`, ... in the plural) `rewards.verifiers.group_function` (per group). `env` and `env_args` are
the task's unless given.

Each function is called as verifiers calls it, by the names it takes: `prompt` and `completion` (verifiers'
message objects: the prompt row's messages, and the stored conversation after them), `answer`, `info`, `task`,
`example_id`, the dataset row's other columns by their names, `state` (rebuilt from the rollout: what the
environment stored in it, `vf_state`, plus prompt, completion, answer, info and one `trajectory` entry per
assistant turn), `parser` and the rubric's other class objects; sync or async. Unlike verifiers (which logs
and scores 0), a function that raises is an error row with the reason.

The version of each reward covers, besides this module and the installed verifiers release, the rubric
function's own code and whatever it reaches (rewards.reach: helpers, constants, an installed environment
package's version), and `env` and `env_args`: editing one reward function of an environment rescores that
reward only, on the stored rollouts (the rollout batch ids do not cover reward functions, tasks/verifiers.py).
"""

from __future__ import annotations

import asyncio
import inspect
import math
from typing import Any

from rewards.declare import group_reward, reward
from storage.schema import Rollout
from storage.verifiers_env import function_name, load_env, rubric_functions

PREFIX = "rewards.verifiers."


def _entry(params: dict[str, Any], name: str | None) -> list[tuple[Any, float, Any]]:
    """The (function, weight, rubric) entries of the env's rubric: all, or the one named (ValueError if absent)."""
    entries = rubric_functions(load_env(params["env"], params.get("env_args")).rubric)
    if name is None:
        return entries
    found = [e for e in entries if function_name(e[0]) == name]
    if not found:
        raise ValueError(f"the rubric of {params['env']!r} has no function {name!r}; it has "
                         f"{[function_name(e[0]) for e in entries]}")
    return found[:1]


def _reaches(params: dict[str, Any]) -> list[Any]:
    return [getattr(fn, "__func__", fn) for fn, _, _ in _entry(params, params.get("function"))]


def _run(value: Any) -> Any:
    if inspect.isawaitable(value):
        return asyncio.run(_awaited(value))
    return value


async def _awaited(value: Any) -> Any:
    return await value


def _state(rollout: Rollout) -> dict[str, Any]:
    """The episode's verifiers state as far as scoring reads it (module docstring)."""
    from verifiers.types import State
    from verifiers.utils.message_utils import normalize_messages

    vf = rollout.metadata.get("vf")
    if not isinstance(vf, dict):
        raise ValueError("the rollout has no verifiers prompt row in its metadata (metadata.vf): it was not made by "
                         "task: verifiers")
    opening = vf["prompt"]
    stored = [m.to_openai() for m in rollout.messages]
    completion = normalize_messages(stored[len(opening):], field_name="completion")
    assistant_turns = sum(1 for m in rollout.messages if m.role == "assistant")
    state = State(input={k: vf[k] for k in ("prompt", "answer", "info", "example_id", "task", "columns") if k in vf})
    state.update(rollout.metadata.get("vf_state") or {})
    state.update({"prompt": normalize_messages(opening, field_name="prompt"), "completion": completion,
                  "answer": vf["answer"], "info": vf["info"], "example_id": vf["example_id"], "task": vf.get("task"),
                  "trajectory": [{"turn": i} for i in range(assistant_turns)], "reward": None, "metrics": None,
                  "error": None, "stop_condition": rollout.metadata.get("vf_stop")})
    return state


def _objects(state: dict[str, Any], rubric: Any) -> dict[str, Any]:
    return {**state["input"].get("columns", {}), "prompt": state["prompt"], "completion": state["completion"],
            "answer": state["answer"], "state": state, "info": state["info"], "task": state["task"],
            "example_id": state["example_id"], **rubric.class_objects}


def _call(fn: Any, objects: dict[str, Any]) -> Any:
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return _run(fn(**objects))
    return _run(fn(**{k: v for k, v in objects.items() if k in params}))


def _group_objects(states: list[dict[str, Any]], rubric: Any) -> dict[str, Any]:
    return {"prompts": [s["prompt"] for s in states], "completions": [s["completion"] for s in states],
            "answers": [s["answer"] for s in states], "states": states, "tasks": [s["task"] for s in states],
            "infos": [s["info"] for s in states], **rubric.class_objects}


def _number(value: Any) -> float:
    value = float(value)  # verifiers' own coercion: a bool is 0/1, an int its float
    if not math.isfinite(value):
        raise ValueError(f"value is not finite: {value}")
    return value


@reward(low=-math.inf, high=math.inf, reaches=_reaches)
def function(rollout: Rollout, function: str, env: str, env_args: dict[str, Any] | None = None) -> float:
    """One individual rubric function of the environment, on one rollout."""
    fn, _, rubric = _entry({"env": env, "env_args": env_args}, function)[0]
    return _number(_call(fn, _objects(_state(rollout), rubric)))


@group_reward(low=-math.inf, high=math.inf, reaches=_reaches)
def group_function(group: list[Rollout], function: str, env: str, env_args: dict[str, Any] | None = None) -> list[float]:
    """One group rubric function of the environment (it takes `states`, `completions`, ...), on one group."""
    fn, _, rubric = _entry({"env": env, "env_args": env_args}, function)[0]
    values = list(_call(fn, _group_objects([_state(r) for r in group], rubric)))
    return [_number(v) for v in values]


@group_reward(low=-math.inf, high=math.inf, reaches=_reaches)
def rubric(group: list[Rollout], env: str, env_args: dict[str, Any] | None = None) -> list[tuple[float, dict[str, Any]]]:
    """The whole rubric, as verifiers' `score_group` computes it: sum of weight x value over its functions, each
    function's value in the details. A function that raises fails the group (its error rows name it)."""
    states = [_state(r) for r in group]
    totals, details = [0.0] * len(group), [dict() for _ in group]
    for fn, weight, holder in _entry({"env": env, "env_args": env_args}, None):
        name = function_name(fn)
        try:
            if _is_group(holder, fn):
                values = [_number(v) for v in _call(fn, _group_objects(states, holder))]
            else:
                values = [_number(_call(fn, _objects(s, holder))) for s in states]
        except Exception as e:
            raise RuntimeError(f"rubric function {name}: {type(e).__name__}: {e}") from e
        for i, v in enumerate(values):
            totals[i] += weight * v
            details[i][name] = v
    return list(zip(totals, details))


def _is_group(holder: Any, fn: Any) -> bool:
    return bool(holder._is_group_func(fn))


def functions() -> None:
    """Not a reward itself: `{fn: rewards.verifiers.functions}` in a run config stands for one reward per rubric
    function (`expand`)."""
    raise ValueError("rewards.verifiers.functions is expanded by the run config (task: verifiers); name "
                     "rewards.verifiers.function with params {function: NAME} to score one function")


def expand(specs: list[dict[str, Any]], env: str, env_args: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A run config's reward specs (dicts) with `rewards.verifiers.functions` replaced by one spec per rubric
    function, and `env`/`env_args` set on every rewards.verifiers spec that leaves them unset."""
    out: list[dict[str, Any]] = []
    for spec in specs:
        fn = spec.get("fn", "") if isinstance(spec, dict) else ""
        if not fn.replace(":", ".").startswith(PREFIX):
            out.append(spec)
            continue
        params = {"env": env, **({"env_args": env_args} if env_args else {}), **(spec.get("params") or {})}
        if fn.replace(":", ".") != PREFIX + "functions":
            out.append({**spec, "params": params})
            continue
        for item, weight, holder in _entry(params, None):
            name = function_name(item)
            kind = "group_function" if _is_group(holder, item) else "function"
            out.append({"name": name, "fn": PREFIX + kind, "weight": weight, "params": {**params, "function": name}})
    return out
