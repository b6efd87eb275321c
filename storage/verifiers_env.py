"""A `verifiers` environment loaded by name or file: the one home shared by the task (tasks/verifiers.py) and the
rubric rewards (rewards/verifiers.py), which sit on one layer and cannot import each other.

`env` is what a verifiers user passes to `vf.load_environment`: an installed module (`my_env`, or the Hub's
`owner/my-env`, whose module is `my_env`), or here also a file (`examples/verifiers_guess/guess_env.py`). Its
`load_environment(**env_args)` builds the environment; one instance is kept per (env, args, file state) in
this process, so the rollout stage's episodes and the score stage's rewards share it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import linecache
import logging
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from storage.settings import no_telemetry

_LOCK = threading.Lock()


def is_file(env: str) -> bool:
    """Whether `env` names a Python file (else an installed module)."""
    return env.endswith(".py")


def env_module(env: str) -> ModuleType:
    """The environment's module: a file executed under a name unique to its path (again when its content
    changed), or an installed module imported by verifiers' own naming (`owner/my-env` -> `my_env`).
    ValueError when it cannot be found or imported."""
    no_telemetry()
    if is_file(env):
        path = Path(env).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"verifiers environment file not found: {path}")
        source = path.read_bytes()
        # One name per path (a reward's version labels code by module name, so an edit elsewhere in the file must
        # not relabel it); an edited file is executed again under that name.
        name = "rlops_vf_" + hashlib.sha256(str(path).encode()).hexdigest()[:16]
        known = sys.modules.get(name)
        if known is not None and getattr(known, "__rlops_source__", None) == source:
            return known
        linecache.cache.pop(str(path), None)  # getsource (versions) must read this content, not an earlier one
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        module.__rlops_source__ = source
        sys.modules[name] = module  # dataclasses and pickling look modules up by name
        try:
            spec.loader.exec_module(module)
        except Exception:
            sys.modules.pop(name, None)
            raise
        return module
    name = env.replace("-", "_").split("/")[-1]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        raise ValueError(f"cannot import the verifiers environment {env!r} (module {name!r}): {e}; install it "
                         "(pip install ...) or name its file (path/to/env.py)") from e


def module_state(env: str) -> Any:
    """What must not change for a cached instance to stand: a file's size and mtime (nothing for a module)."""
    if not is_file(env):
        return None
    stat = Path(env).expanduser().resolve().stat()
    return (stat.st_size, stat.st_mtime_ns)


def load_env(env: str, env_args: dict[str, Any] | None = None) -> Any:
    """The environment `load_environment(**env_args)` of `env` builds (one per process for each env, args and file
    state). ValueError when the module has no `load_environment`, or it raises or returns no environment."""
    import verifiers as vf

    args = dict(env_args or {})
    if is_file(env) and not Path(env).expanduser().is_file():
        raise ValueError(f"verifiers environment file not found: {Path(env).expanduser().resolve()}")
    key = (str(Path(env).expanduser().resolve()) if is_file(env) else env,
           json.dumps(args, sort_keys=True, default=str), module_state(env))
    with _LOCK:
        # Kept on the function, not in a module value: a reward's version describes this module's values.
        cache = load_env.__dict__.setdefault("instances", {})
        if key in cache:
            return cache[key]
        logging.getLogger("verifiers").setLevel(logging.WARNING)
        module = env_module(env)
        load = getattr(module, "load_environment", None)
        if load is None:
            raise ValueError(f"the verifiers environment {env!r} has no load_environment(**kwargs)")
        try:
            with quiet_datasets():
                instance = load(**args)
        except Exception as e:
            raise ValueError(f"{env!r}: load_environment({', '.join(f'{k}={v!r}' for k, v in args.items())}) "
                             f"failed: {type(e).__name__}: {e}") from e
        if not isinstance(instance, vf.Environment):
            raise ValueError(f"{env!r}: load_environment returned a {type(instance).__name__}, not a "
                             "verifiers Environment")
        instance.env_id = instance.env_id or env
        cache[key] = instance
        return instance


@contextmanager
def quiet_datasets() -> Iterator[None]:
    """`datasets`' progress bars off for the block (an environment's `Dataset.map` calls would print a bar each on
    the console of `rlops run`), as they were after it."""
    from datasets.utils.logging import disable_progress_bar, enable_progress_bar, is_progress_bar_enabled

    was = is_progress_bar_enabled()
    disable_progress_bar()
    try:
        yield
    finally:
        if was:
            enable_progress_bar()


def rubric_functions(rubric: Any) -> list[tuple[Any, float, Any]]:
    """(function, weight, the rubric holding it) for every reward function and metric of a rubric, a RubricGroup's
    members flattened in order (what verifiers' own scoring walks)."""
    members = getattr(rubric, "rubrics", None)
    if members is not None:
        return [entry for member in members for entry in rubric_functions(member)]
    return [(fn, float(weight), rubric) for fn, weight in zip(rubric.funcs, rubric.weights)]


def function_name(fn: Any) -> str:
    """A rubric function's name as verifiers reports it (its metrics' keys)."""
    return getattr(fn, "__name__", repr(fn))
