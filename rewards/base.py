"""The reward protocol: plain functions, declared ranges, source-hash versions, and `compute`.

A reward is a function over one `Rollout` (or, for rankers, over one group `list[Rollout]`)
that returns a float or `(float, details_dict)`:

    @reward(low=0.0, high=1.0)
    def exact_match(rollout: Rollout, key: str = "answer") -> float: ...

    @group_reward(low=0.0, high=1.0)
    def my_ranker(group: list[Rollout]) -> list[float]: ...   # one value per rollout, same order

A `RewardSpec` names the function by import path (`rewards.builtin.exact_match`) or by file
(`my_rewards.py:my_fn`) and gives its params and weight. The version of a reward is a short hash
of everything that can change its values: its source and all of the user's code it reaches
(helpers, classes, module constants, closures, defaults; see `rewards.reach`), the installed
libraries it uses by name and version, the data files it declares, and its params. An edit
anywhere in that reach changes the version; an edit outside it does not.

`compute` never raises because of what a reward does on a rollout: exceptions, NaN/inf,
non-numbers and out-of-range values become an `Outcome` with value None and the reason in
`error`. A spec that cannot be loaded at all (bad path, undecorated function, params the
function does not take) is a config error and raises `ValueError` up front.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import linecache
import math
import numbers
import sys
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from rewards.declare import NOT_APPLICABLE, NotApplicable, RewardInfo, group_reward, reward  # noqa: F401 - re-exported
from rewards.reach import ReachWarning, reach
from rewards.reach_origin import USER_FILE_MODULE_PREFIX, is_installed_file, local_path, path_content_hash
from storage.ids import canonical_json
from storage.schema import Rollout

MAX_ERROR_CHARS = 500  # an error is a short reason in a Parquet cell, not a log


class RewardSpec(BaseModel):
    """One reward in a config: which function, with which params, and its weight in the total."""

    model_config = ConfigDict(extra="forbid")

    name: str = ""  # column value `reward_name`; defaults to the function's name
    fn: str  # `pkg.module.function`, `pkg.module:function`, or `path/to/file.py:function`
    params: dict[str, Any] = {}
    weight: float = 1.0  # only used by the weighted total
    # Whose signature `fn` has: rlops' own (@reward / @group_reward), or a peer's, called through rewards/peers.py:
    # TRL's `f(prompts, completions, completion_ids, **columns) -> [float | None]` (or a factory of one),
    # verl's `compute_score(data_source, solution_str, ground_truth, extra_info)`, OpenRLHF's
    # `reward_func(queries, prompts, labels)`.
    style: Literal["rlops", "trl", "verl", "openrlhf"] = "rlops"

    @model_validator(mode="after")
    def _default_name(self) -> RewardSpec:
        if not self.name:
            self.name = self.fn.replace(":", ".").rsplit(".", 1)[-1]
        return self



@dataclass(frozen=True)
class Outcome:
    """The result of one reward on one rollout: a value, or None and the reason in `error`; None and no error is
    "not applicable" (`NOT_APPLICABLE`)."""

    value: float | None
    details: dict[str, Any] | None = None
    error: str | None = None
    details_json: str | None = field(default=None, compare=False, repr=False)  # `details` encoded by `check`

    @property
    def applicable(self) -> bool:
        """False for a rollout the reward does not apply to (a null value that is not an error)."""
        return self.value is not None or self.error is not None


def load_reward(spec: RewardSpec) -> Callable[..., Any]:
    """The spec's reward as an rlops reward function: its own (`style: rlops`), or a peer's function wrapped by
    rewards/peers.py. The one place a spec becomes a function (ValueError if it cannot)."""
    if spec.style == "rlops":
        return load_fn(spec.fn)
    from rewards.peers import adapt

    return adapt(import_callable(spec.fn), spec.style, spec.params, spec.fn)


def import_callable(path: str) -> Callable[..., Any]:
    """What `pkg.module.fn`, `pkg.module:fn` or `file.py:fn` names (ValueError if it cannot be imported)."""
    if ":" in path:
        where, attr = path.rsplit(":", 1)
    else:
        where, _, attr = path.rpartition(".")
    try:
        if where.endswith(".py"):
            module = _load_file(Path(where))
        else:
            module = importlib.import_module(where)
        fn = getattr(module, attr)
    except (ImportError, AttributeError, FileNotFoundError, ValueError) as e:
        raise ValueError(f"cannot load reward {path!r}: {type(e).__name__}: {e}") from e
    if not callable(fn):
        raise ValueError(f"{path!r} is a {type(fn).__name__}, not a function")
    return fn


def load_fn(path: str) -> Callable[..., Any]:
    """Import an rlops reward function by `pkg.module.fn`, `pkg.module:fn` or `file.py:fn` (ValueError if it is not one)."""
    fn = import_callable(path)
    if not isinstance(getattr(fn, "__reward__", None), RewardInfo):
        from rewards.peers import guess_style

        style = guess_style(fn)
        hint = f", or set `style: {style}` (its signature is {style}'s)" if style else ""
        raise ValueError(f"{path!r} is not declared as a reward: decorate it with @reward(...) or @group_reward(...){hint}")
    return fn


def _load_file(path: Path) -> Any:
    # A user reward file is executed fresh on every load (never a stale module from sys.modules), under a
    # name unique to its path, and its lines are dropped from linecache so getsource reads the current file.
    # Like a script, it can import the modules next to it; those are imported fresh too, so that in a
    # long-running process (a served schedule) an edited helper module is both what runs and what the
    # version reads, never an old module object next to new source text.
    path = path.resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    _forget_modules_of(path.parent)
    if str(path.parent) in sys.path:
        sys.path.remove(str(path.parent))
    sys.path.insert(0, str(path.parent))  # first: a same-named module of another reward folder must not win
    name = USER_FILE_MODULE_PREFIX + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"not a Python file: {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling in the user's module look themselves up here
    linecache.cache.pop(str(path), None)
    spec.loader.exec_module(module)
    return module


_RLOPS_PACKAGES = ("rewards", "storage", "tasks", "stages", "flows")  # never re-imported: their classes must stay one


def _forget_modules_of(folder: Path) -> None:
    """Drop from sys.modules the user modules in `folder`, and those its files would shadow."""
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        top = name.partition(".")[0]
        if not file or top in _RLOPS_PACKAGES or is_installed_file(file):
            continue
        shadowed = (folder / f"{top}.py").exists() or (folder / top / "__init__.py").exists()
        if shadowed or Path(file).resolve().is_relative_to(folder):
            del sys.modules[name]


def info(fn: Callable[..., Any]) -> RewardInfo:
    """The declaration of a decorated reward function."""
    return fn.__reward__  # type: ignore[attr-defined]


def _bound_params(fn: Callable[..., Any], params: dict[str, Any]) -> dict[str, Any]:
    # Binding fills in defaults, so `{}` and `{"limit": 512}` (the default) are the same version,
    # and a param the function does not take is caught here, before any rollout is scored.
    sig = inspect.signature(fn)
    try:
        bound = sig.bind(None, **params)
    except TypeError as e:
        raise ValueError(f"params {sorted(params)} do not fit {fn.__name__}{sig}: {e}") from e
    bound.apply_defaults()
    out: dict[str, Any] = {}
    for name, value in list(bound.arguments.items())[1:]:  # [0] is the rollout / group
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            out[name] = value
    return out


def short_hash(value: Any) -> str:
    """12 hex chars of sha256 over the canonical JSON of `value`."""
    return hashlib.sha256(canonical_json(value, strict=True).encode()).hexdigest()[:12]


def fn_version(fn: Callable[..., Any], params: dict[str, Any]) -> str:
    """Version of a decorated reward under `params`: hash of its declaration, its reach (`rewards.reach`:
    code, values, libraries, declared files) and its versioned params. Where the reach cannot be
    determined (eval, dynamic imports), a `ReachWarning` says why and the whole module is versioned."""
    decl = info(fn)
    extra = tuple(decl.reaches(_bound_params(fn, params))) if decl.reaches is not None else ()
    found = reach(fn, uses=(*decl.uses, *extra), files=decl.files)
    for message in found.warnings if decl.reaches is None else ():  # `reaches` declares the dynamic part itself
        warnings.warn(message, ReachWarning, stacklevel=2)
    versioned = {k: v for k, v in _bound_params(fn, params).items() if k not in decl.unversioned}
    for name in decl.content:
        if isinstance(versioned.get(name), str) and (path := local_path(versioned[name])) is not None:
            versioned[name] = {"path": versioned[name], "content": path_content_hash(path)}
    bounds = [b if math.isfinite(b) else str(b) for b in (decl.low, decl.high)]  # a peer's reward is unbounded
    identity = {"reward": [decl.kind, *bounds], "reach": found.fingerprint(), "params": versioned}
    try:
        return short_hash(identity)
    except TypeError as e:
        raise ValueError(f"params of {fn.__name__} must be JSON values: {e}") from e


def reward_version(spec: RewardSpec) -> str:
    """The `reward_version` of a spec (ValueError if the spec cannot be loaded)."""
    return fn_version(load_reward(spec), spec.params)


def task_problems(spec: RewardSpec, task_name: str, task_params: dict[str, Any]) -> list[str]:
    """What the reward's own `task_check` finds wrong with `spec` on this task (empty without a check)."""
    check_task = info(load_reward(spec)).task_check
    return [] if check_task is None else check_task(task_name, task_params, spec.params)


def fill_params(spec: RewardSpec, **context: Any) -> RewardSpec:
    """A copy of `spec` with each `context` value set where its function takes that param and the spec
    leaves it unset: how the score stage passes workspace context, e.g. `cache_dir=<workspace>/cache/judge`."""
    accepted = inspect.signature(load_reward(spec)).parameters  # one load: a file reward is executed on each
    extra = {k: v for k, v in context.items() if k in accepted and k not in spec.params}
    return spec.model_copy(update={"params": {**spec.params, **extra}})


def takes(spec: RewardSpec, param: str) -> bool:
    """Whether the spec's function has a parameter named `param` (ValueError if the spec cannot be loaded)."""
    return param in inspect.signature(load_reward(spec)).parameters


def describe_error(e: BaseException) -> str:
    """`Type: message`, one short line: what a Parquet `error` cell holds (no traceback)."""
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def check(result: Any, decl: RewardInfo) -> Outcome:
    """Turn what a reward returned into an Outcome, rejecting non-numbers, NaN/inf and out-of-range values."""
    details = encoded = None
    if result is NOT_APPLICABLE:
        return Outcome(None, {"not_applicable": True}, None)
    if isinstance(result, tuple):
        if len(result) != 2 or not isinstance(result[1], dict):
            return Outcome(None, None, f"expected a float or (float, dict), got a tuple of {len(result)}")
        result, details = result
        if result is NOT_APPLICABLE:
            return Outcome(None, {**details, "not_applicable": True}, None)
        try:
            encoded = canonical_json(details, strict=True)  # the stage writes details as JSON (DuckDB reads it): find out now, per row
        except (TypeError, ValueError) as e:
            return Outcome(None, None, f"details are not JSON-serializable: {describe_error(e)}")
    # bool is a Number in Python, but a reward returning True is almost always a forgotten float(...)
    if isinstance(result, bool) or not isinstance(result, numbers.Real):
        return Outcome(None, details, f"expected a number, got {type(result).__name__}")
    value = float(result)
    if not math.isfinite(value):
        return Outcome(None, details, f"value is not finite: {value}")
    if not decl.low <= value <= decl.high:
        return Outcome(None, details, f"value {value} outside the declared range [{decl.low}, {decl.high}]")
    return Outcome(value, details, None, encoded)


def _score_group(fn: Callable[..., Any], decl: RewardInfo, group: list[Rollout], params: dict[str, Any]) -> list[Outcome]:
    try:
        results = fn(group, **params)
        results = list(results)
    except Exception as e:  # failures are data: the whole group gets the reason
        return [Outcome(None, None, describe_error(e))] * len(group)
    if len(results) != len(group):
        return [Outcome(None, None, f"group reward returned {len(results)} values for {len(group)} rollouts")] * len(group)
    return [check(r, decl) for r in results]


def _score_one(fn: Callable[..., Any], decl: RewardInfo, rollout: Rollout, params: dict[str, Any]) -> Outcome:
    try:
        return check(fn(rollout, **params), decl)
    except Exception as e:  # failures are data: one bad rollout does not stop the batch
        return Outcome(None, None, describe_error(e))


def compute(spec: RewardSpec, rollouts: Sequence[Rollout], *, workers: int = 1) -> list[Outcome]:
    """Score `rollouts` with one reward: one Outcome per rollout, in input order.

    Group rewards are called once per `group_id` (rollouts in input order within the group).
    `workers` > 1 scores rollouts (or groups) in that many threads, which is what lets a judge
    keep several requests in flight; rewards must then be thread-safe (the built-ins are).
    Raises ValueError only if the spec cannot be loaded.
    """
    fn = load_reward(spec)
    decl = info(fn)
    _bound_params(fn, spec.params)  # config errors raise here, not once per rollout
    if decl.kind == "rollout":
        units: list[list[int]] = [[i] for i in range(len(rollouts))]
    else:
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(rollouts):
            groups.setdefault(r.group_id, []).append(i)
        units = list(groups.values())

    def run(unit: list[int]) -> list[Outcome]:
        if decl.kind == "rollout":
            return [_score_one(fn, decl, rollouts[unit[0]], spec.params)]
        return _score_group(fn, decl, [rollouts[i] for i in unit], spec.params)

    if workers > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(run, units))
    else:
        results = [run(u) for u in units]
    out: list[Outcome | None] = [None] * len(rollouts)
    for unit, outcomes in zip(units, results):
        for i, o in zip(unit, outcomes):
            out[i] = o
    return out  # type: ignore[return-value]  # every index is in exactly one unit


def total_version(specs: Sequence[RewardSpec]) -> str:
    """Version of the weighted total: hash of its components' names, versions and weights."""
    _check_names(specs)
    return short_hash([[s.name, reward_version(s), s.weight] for s in specs])


def weighted_total(specs: Sequence[RewardSpec], components: Sequence[Sequence[Outcome]]) -> list[Outcome]:
    """Per rollout, sum(weight * value) over the specs; null (with the reason) if any component failed.

    A component that does not apply to the rollout (`NOT_APPLICABLE`, TRL's None) is left out of the sum, as TRL's
    `nansum` leaves it out; a rollout no component applies to is not applicable itself (TRL would train on 0 there,
    with a warning). `components[j]` are the outcomes of `specs[j]`, aligned by rollout. Details hold each
    component value.
    """
    _check_names(specs)
    if len(components) != len(specs) or len({len(c) for c in components}) > 1:
        raise ValueError("components must hold one equally long outcome list per spec")
    out = []
    for row in zip(*components):
        parts = {s.name: o.value for s, o in zip(specs, row)}
        missing = [s.name for s, o in zip(specs, row) if o.value is None and o.applicable]
        applying = [(s, o) for s, o in zip(specs, row) if o.value is not None]
        if missing:
            out.append(Outcome(None, {"components": parts}, f"component(s) without a value: {', '.join(missing)}"))
        elif not applying:
            out.append(Outcome(None, {"components": parts, "not_applicable": True}, None))
        else:
            total = sum(s.weight * o.value for s, o in applying)  # type: ignore[operator]
            out.append(Outcome(total, {"components": parts}, None))
    return out


def _check_names(specs: Sequence[RewardSpec]) -> None:
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"reward names must be unique, got {names}")

