"""External agent tasks: an agent written against an OpenAI-compatible client, trained unchanged.

    task:
      name: agent
      params:
        entry: examples/doc_search_openai/agent.py:rollout   # or package.module:rollout
        prompts: examples/doc_search_openai/prompts.jsonl

The entry is a plain coroutine function, with no rlops import needed:

    async def rollout(client: openai.AsyncOpenAI, model: str, prompt: str) -> dict | list | None

The rollout stage serves the policy being trained (stages/service/service.py, on 127.0.0.1) and calls it G
times per prompt, concurrently, with a client whose every request is recorded under that episode;
the agent must pass `model` on as the request's `model`. Its result may be
  - a dict with `messages` (the final conversation, OpenAI message dicts or the client's message
    objects) and/or `metadata` (a dict of fields for the rewards, added to the prompt's metadata),
  - a list (the final conversation), or
  - None: the service's record of the episode's last call is the conversation.
An agent that raises or times out becomes an error row (finish_reason "error", no tokens, the
error in metadata["error"]); the stage fails only when more than `max_error_frac` of a shard's
episodes are errors.

The prompts file is JSONL, one prompt a line: {"id": "q1", "prompt": "...", "split": "train",
"metadata": {...}}. `prompt` is what the agent receives; `metadata` (ground truth) is stored with
the rollout for the rewards and never shown to the agent; `split` defaults to "train".
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import sys
from pathlib import Path
from typing import Any, Callable

from tasks.base import AgentSpec, Prompt, Task


def load_entry(entry: str) -> tuple[Callable[..., Any], Path]:
    """The coroutine function named by "package.module:fn" or "path/to/file.py:fn", and its source file."""
    target, sep, name = entry.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"entry must look like 'package.module:function' or 'file.py:function', got {entry!r}")
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not path.exists():
            raise ValueError(f"entry file not found: {path}")
        module_name = "rlops_agent_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            raise ValueError(f"cannot import the agent module {target!r}: {e}") from e
        path = Path(module.__file__)
    fn = getattr(module, name, None)
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"{entry!r} must name an `async def {name}(client, model, prompt)` function")
    return fn, path


def read_prompts(path: Path) -> dict[str, list[Prompt]]:
    """Split -> prompts of a prompts file, in file order; a bad line is an error naming it."""
    splits: dict[str, list[Prompt]] = {}
    seen: set[str] = set()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from e
        if not isinstance(row, dict) or not isinstance(row.get("id"), str) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path}:{n}: each line needs a string 'id' and a string 'prompt'")
        if row["id"] in seen:
            raise ValueError(f"{path}:{n}: duplicate id {row['id']!r}")
        if not isinstance(row.get("metadata", {}), dict):
            raise ValueError(f"{path}:{n}: 'metadata' must be an object")
        seen.add(row["id"])
        splits.setdefault(row.get("split", "train"), []).append(Prompt(row["id"], row["prompt"], row.get("metadata", {})))
    return splits


def make_task(entry: str, prompts: str, name: str = "agent", max_error_frac: float = 0.25,
              episode_timeout: float = 600.0) -> Task:
    """An external agent task: `entry` runs each episode, `prompts` (JSONL) lists the prompts.

    `name` goes into the rollouts' `task` column; `max_error_frac` is the share of a shard's
    episodes that may raise before the stage fails (a flaky tool should not stop training, a
    broken agent should); `episode_timeout` bounds one episode, in seconds.
    """
    if not 0.0 <= max_error_frac <= 1.0:
        raise ValueError(f"max_error_frac must be in [0, 1], got {max_error_frac}")
    fn, source = load_entry(entry)
    path = Path(prompts).expanduser().resolve()
    if not path.exists():
        raise ValueError(f"prompts file not found: {path}")
    splits = read_prompts(path)
    version = hashlib.sha256(source.read_bytes() + b"\0" + path.read_bytes()).hexdigest()[:16]

    def by_split(split: str) -> list[Prompt]:
        return list(splits.get(split, []))

    return Task(name=name, system_prompt="", prompts=by_split,
                agent=AgentSpec(entry, fn, version, max_error_frac, episode_timeout))
