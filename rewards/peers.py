"""Reward functions as TRL, verl and OpenRLHF users write them, called on rlops rollouts unchanged.

    score:
      rewards:
        - {fn: trl.rewards.accuracy_reward, style: trl}                       # TRL's own, from the installed TRL
        - {fn: trl.rewards.get_soft_overlong_punishment, style: trl,           # a factory: called with params
           params: {max_completion_len: 64, soft_punish_cache: 16}}
        - {fn: my_rewards.py:compute_score, style: verl}                      # verl's compute_score
        - {fn: my_rewards.py:reward_func, style: openrlhf}                    # OpenRLHF's --remote_rm_url file

`adapt` turns such a function into an rlops reward (rewards.base), once, here: nothing past this module knows
which peer a reward came from. Its version is any reward's (rewards.reach): the function's source and the user
code it reaches, the libraries it uses by version (so TRL's built-ins are versioned by TRL's release), the
factory params; so editing the function rescores, and an unchanged one is found in the catalog.

- **trl** (a group reward): called once per group with `prompts`, `completions` (conversational, a list of
  messages, unless the prompt was plain text: tasks/dataset.py records `prompt_format`), `completion_ids` (the
  tokens the policy sampled; passed only to a function that names it, since reading tokens slows rescoring), every
  metadata field (the dataset's columns) as a keyword list, `log_extra` and `log_metric` (what they log lands in
  the rows' details) and `trainer_state=None`; a function without `**kwargs` gets only what it names. Params are
  passed as keywords too. A function that takes none of `prompts`, `completions`, `completion_ids` is a factory
  (TRL's `get_*`): it is called with the params and its result is the reward. `None` is "not applicable"
  (`rewards.base.NOT_APPLICABLE`), which the weighted total leaves out as TRL's `nansum` does.
- **verl** (per rollout): `compute_score(data_source=, solution_str=, ground_truth=, extra_info=, **params)`
  with the final reply as `solution_str`, `reward_model.ground_truth` (else metadata["answer"]) as `ground_truth`;
  a dict result gives its `score`, and its other keys are kept as details.
- **openrlhf** (a group reward): `reward_func(queries, prompts, labels)`, queries being prompt + reply text,
  prompts the user message and labels metadata["answer"] (OpenRLHF's `--label_key`); a tensor or list, or a dict
  with `rewards`.

Peers' rewards are unbounded: any finite number is a value. A bool counts as 0/1 (peers return `a == b`).
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable
from typing import Any

from rewards.declare import NOT_APPLICABLE, group_reward, reward
from rewards.builtin import final_answer
from rewards.reach_origin import label_of
from storage.schema import Rollout

TRL_ARGS = ("prompts", "completions", "completion_ids")
NOT_COLUMNS = {"prompt", "completion", "completion_ids", "prompt_format"}  # TRL's exclusions, and rlops' own marker


def adapt(fn: Callable[..., Any], style: str, params: dict[str, Any], path: str) -> Callable[..., Any]:
    """`fn`, written in `style` ("trl", "verl", "openrlhf"), as an rlops reward function taking `params`.
    Raises ValueError when `fn` does not have that style's signature, or a factory rejects the params."""
    if getattr(fn, "__reward__", None) is not None:
        raise ValueError(f"{path!r} is an rlops reward (@reward / @group_reward): remove `style: {style}`")
    guessed = guess_style(fn)
    if guessed is not None and guessed != style:
        raise ValueError(f"{path} has {guessed}'s signature {inspect.signature(fn)}, not {style}'s: set `style: {guessed}`")
    if style == "trl":
        return _trl(fn, params, path)
    if style == "verl":
        return _verl(fn, params, path)
    if style == "openrlhf":
        return _openrlhf(fn, path)
    raise ValueError(f"unknown reward style {style!r}")


def guess_style(fn: Callable[..., Any]) -> str | None:
    """The peer whose signature `fn` has, by its parameter names (None: none of theirs)."""
    try:
        names = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    if {"queries", "labels"} <= names:
        return "openrlhf"
    if {"solution_str", "ground_truth"} <= names:
        return "verl"
    if names & {"completions", "completion_ids"}:
        return "trl"
    return None


def required_columns(fn: Callable[..., Any], params: dict[str, Any]) -> list[str]:
    """The keyword arguments a TRL-style function (or the one its factory makes of `params`) requires beyond
    TRL's own and the params: the dataset columns it reads (`solution` for `trl.rewards.accuracy_reward`)."""
    names, any_kw = _signature(fn, getattr(fn, "__name__", "reward"))
    if not (names & set(TRL_ARGS)) and not any_kw:
        fn = fn(**params)
    own = set(TRL_ARGS) | {"trainer_state", "log_extra", "log_metric"} | set(params)
    return [n for n, p in inspect.signature(fn).parameters.items()
            if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in own]


def _trl(fn: Callable[..., Any], params: dict[str, Any], path: str) -> Callable[..., Any]:
    names, any_kw = _signature(fn, path)
    if not (names & set(TRL_ARGS)) and not any_kw:  # a factory (get_soft_overlong_punishment): params make the reward
        try:
            target = fn(**params)
        except Exception as e:  # noqa: BLE001 - a factory that rejects its params is a config error
            raise ValueError(f"{path}(**{params}) failed: {type(e).__name__}: {e}") from e
        if not callable(target):
            raise ValueError(f"{path}(**params) returned a {type(target).__name__}, not a reward function")
        call_params: dict[str, Any] = {}
        names, any_kw = _signature(target, path)
        if not (names & set(TRL_ARGS)) and not any_kw:
            raise ValueError(f"{path}: neither a TRL reward function (it takes none of {', '.join(TRL_ARGS)}) "
                             "nor a factory of one")
    else:
        target, call_params = fn, dict(params)
        unknown = [k for k in params if k not in names and not any_kw]
        if unknown:
            raise ValueError(f"{path} takes no parameter {', '.join(unknown)} (params are passed as keywords)")
    reads_tokens = "completion_ids" in names

    # `uses`: which function it is, by name (a library's functions all enter the reach as its one version)
    @group_reward(low=-math.inf, high=math.inf, tokens=reads_tokens, uses=(label_of(fn),))
    def trl_reward(group: list[Rollout], **_params: Any) -> list[Any]:
        return call_trl(target, group, call_params, with_ids=reads_tokens)

    return trl_reward


def call_trl(fn: Callable[..., Any], group: list[Rollout], params: dict[str, Any], *, with_ids: bool) -> list[Any]:
    """Call a TRL reward function on one group as GRPOTrainer would: one value per rollout, None -> not applicable,
    with what it logged (`log_extra`, `log_metric`) in each rollout's details."""
    conversational = group[0].metadata.get("prompt_format") != "text"
    prompts, completions = [], []
    for r in group:
        opening, rest = _split_opening(r)
        if conversational:
            prompts.append([{"role": m.role, "content": m.content or ""} for m in opening])
            completions.append([{"role": m.role, "content": m.content or ""} for m in rest])
        else:
            prompts.append(_question(opening))
            completions.append(final_answer(r) or "")
    keys = dict.fromkeys(k for r in group for k in r.metadata if k not in NOT_COLUMNS)
    extra: dict[str, list[Any]] = {}
    metrics: dict[str, list[float]] = {}
    kwargs: dict[str, Any] = {
        "prompts": prompts, "completions": completions,
        **{k: [r.metadata.get(k) for r in group] for k in keys},
        "trainer_state": None, "log_extra": lambda name, values: extra.__setitem__(name, list(values)),
        "log_metric": lambda name, value: metrics.setdefault(name, []).append(float(value)), **params}
    if with_ids:
        kwargs["completion_ids"] = [[t for t, m in zip(r.token_ids, r.loss_mask) if m] for r in group]
    values = list(_run(fn, **_accepted(fn, kwargs)))
    if len(values) != len(group):
        raise ValueError(f"returned {len(values)} values for {len(group)} completions")
    out = []
    for i, value in enumerate(values):
        details = {name: logged[i] for name, logged in extra.items() if i < len(logged)}
        if metrics:
            details["metrics"] = {name: sum(v) / len(v) for name, v in metrics.items()}
        out.append((_number(value), details) if details else _number(value))
    return out


def _verl(fn: Callable[..., Any], params: dict[str, Any], path: str) -> Callable[..., Any]:
    names, any_kw = _signature(fn, path)
    missing = [n for n in ("solution_str", "ground_truth") if n not in names and not any_kw]
    if missing:
        raise ValueError(f"{path} is not a verl compute_score: it takes no {', '.join(missing)} "
                         "(compute_score(data_source, solution_str, ground_truth, extra_info=None))")
    unknown = [k for k in params if k not in names and not any_kw]
    if unknown:
        raise ValueError(f"{path} takes no parameter {', '.join(unknown)} (params are passed as keywords)")
    call_params = dict(params)

    @reward(low=-math.inf, high=math.inf, uses=(label_of(fn),))
    def verl_reward(rollout: Rollout, **_params: Any) -> Any:
        return call_verl(fn, rollout, call_params)

    return verl_reward


def call_verl(fn: Callable[..., Any], rollout: Rollout, params: dict[str, Any]) -> Any:
    """verl's `compute_score` on one rollout: its score, with a dict result's other keys as details."""
    meta = rollout.metadata
    truth = meta.get("reward_model", {}).get("ground_truth") if isinstance(meta.get("reward_model"), dict) else None
    kwargs = {"data_source": meta.get("data_source", rollout.task), "solution_str": final_answer(rollout) or "",
              "ground_truth": truth if truth is not None else meta.get("answer"),
              "extra_info": meta.get("extra_info"), **params}
    result = _run(fn, **_accepted(fn, kwargs))
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"compute_score returned a dict without 'score' (keys: {', '.join(map(str, result))})")
        return _number(result["score"]), {k: v for k, v in result.items() if k != "score"}
    return _number(result)


def _openrlhf(fn: Callable[..., Any], path: str) -> Callable[..., Any]:
    try:
        inspect.signature(fn).bind([], [], [])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path} is not an OpenRLHF reward_func(queries, prompts, labels): {e}") from e

    @group_reward(low=-math.inf, high=math.inf, uses=(label_of(fn),))
    def openrlhf_reward(group: list[Rollout], **_params: Any) -> list[Any]:
        return call_openrlhf(fn, group)

    return openrlhf_reward


def call_openrlhf(fn: Callable[..., Any], group: list[Rollout]) -> list[Any]:
    """OpenRLHF's `reward_func(queries, prompts, labels)` on one group; a dict result's `rewards` are the values."""
    prompts = [_question(_split_opening(r)[0]) for r in group]
    queries = [p + (final_answer(r) or "") for p, r in zip(prompts, group)]
    result = _run(fn, queries, prompts, [r.metadata.get("answer") for r in group])
    if isinstance(result, dict):
        result = result["rewards"]
    values = result.tolist() if hasattr(result, "tolist") else list(result)
    if len(values) != len(group):
        raise ValueError(f"returned {len(values)} values for {len(group)} queries")
    return [_number(v) for v in values]


def _signature(fn: Callable[..., Any], path: str) -> tuple[set[str], bool]:
    """(named parameters, whether it takes **kwargs)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: no readable signature ({e})") from e
    named = {n for n, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return named, any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())


def _accepted(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keywords `fn` takes: all of them with **kwargs, else those it names."""
    names, any_kw = _signature(fn, getattr(fn, "__name__", "reward"))
    return kwargs if any_kw else {k: v for k, v in kwargs.items() if k in names}


def _run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call `fn`; an async one runs to completion (TRL takes async reward functions)."""
    result = fn(*args, **kwargs)
    return asyncio.run(result) if inspect.isawaitable(result) else result


def _number(value: Any) -> Any:
    """None -> not applicable; a bool -> 0/1; a tensor or NumPy scalar -> its number; anything else as it is,
    for `rewards.base.check` to accept or turn into an error row."""
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if value is None:
        return NOT_APPLICABLE
    return float(value) if isinstance(value, bool) else value


def _split_opening(rollout: Rollout) -> tuple[list[Any], list[Any]]:
    """(the messages before the first assistant turn, the rest)."""
    first = next((i for i, m in enumerate(rollout.messages) if m.role == "assistant"), len(rollout.messages))
    return rollout.messages[:first], rollout.messages[first:]


def _question(opening: list[Any]) -> str:
    return next((m.content or "" for m in reversed(opening) if m.role == "user"), "")
