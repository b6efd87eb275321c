"""External agent tasks: an agent written against an OpenAI-compatible client, trained unchanged.

    task:
      name: agent
      params:
        entry: examples/doc_search_openai/agent.py:rollout   # or package.module:rollout
        # or: url: http://127.0.0.1:8300/rollout            # an agent service, any process or language
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

An agent service (`url`) is the same contract over HTTP (stages/service/external.py): for each episode
the rollout stage POSTs {"prompt_id", "prompt", "base_url", "model", "episode_id"} (JSON) and takes back
{"messages"?, "metadata"?} (JSON; no messages: the service's record stands). The agent calls
`base_url` (the policy service, e.g. `http://127.0.0.1:PORT/v1`) with `model` and the header
`X-Episode-Id: <episode_id>` on every request. An HTTP error, a timeout or a malformed reply is an
error row with its reason. Its code is not in this process, so its version is what the service says
at `GET /version` on the same host, or the `version` param (bump it when the agent changes): either
way it enters the rollout batch id with the prompts file.

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


def make_task(prompts: str, entry: str | None = None, url: str | None = None, version: str | None = None,
              name: str = "agent", max_error_frac: float = 0.25, episode_timeout: float = 600.0) -> Task:
    """An external agent task: `entry` (a coroutine in this process) or `url` (an agent service) runs
    each episode; `prompts` (JSONL) lists the prompts.

    `version` names an agent service's version (bump it when the agent changes); without it, the
    service's `GET /version` answers (see `service_version`). An entry's version is its source file's hash.
    `name` goes into the rollouts' `task` column; `max_error_frac` is the share of a shard's
    episodes that may fail before the stage fails (a flaky tool should not stop training, a
    broken agent should); `episode_timeout` bounds one episode, in seconds.
    """
    if not 0.0 <= max_error_frac <= 1.0:
        raise ValueError(f"max_error_frac must be in [0, 1], got {max_error_frac}")
    if (entry is None) == (url is None):
        raise ValueError("task.params: give either 'entry' (a coroutine function) or 'url' (an agent service)")
    path = Path(prompts).expanduser().resolve()
    if not path.exists():
        raise ValueError(f"prompts file not found: {path}")
    splits = read_prompts(path)
    if entry is not None:
        if version is not None:
            raise ValueError("task.params.version is for an agent service (url); an entry's version is its source's hash")
        fn, source = load_entry(entry)
        agent_code = source.read_bytes()
    else:
        fn, entry = None, ""
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"task.params.url: an http(s) URL of the agent service's rollout endpoint, got {url!r}")
        agent_code = b"service:" + (version if version is not None else service_version(url)).encode()
    version_hash = hashlib.sha256(agent_code + b"\0" + path.read_bytes()).hexdigest()[:16]

    def by_split(split: str) -> list[Prompt]:
        return list(splits.get(split, []))

    return Task(name=name, system_prompt="", prompts=by_split,
                agent=AgentSpec(entry, fn, version_hash, max_error_frac, episode_timeout, url=url))


def version_url(url: str) -> str:
    """Where an agent service says its version: `GET /version` on the rollout URL's host."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/version", "", ""))


def service_version(url: str, timeout: float = 10.0) -> str:
    """The agent service's own version: the body of `GET /version` (text, or JSON {"version": ...}).
    A service that cannot be reached, or has no version endpoint, is a config error: then give
    `task.params.version` (and bump it when the agent changes)."""
    import httpx

    where = version_url(url)
    try:
        response = httpx.get(where, timeout=timeout)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach the agent service at {where}: {type(e).__name__}: {e}") from e
    if response.status_code != 200:
        raise ValueError(f"the agent service answered GET {where} with HTTP {response.status_code}: serve a "
                         "version there or set task.params.version")
    try:
        body = response.json()
        text = body["version"] if isinstance(body, dict) else body
    except (ValueError, KeyError):
        text = response.text
    if not str(text).strip():
        raise ValueError(f"the agent service's {where} is empty: serve a version there or set task.params.version")
    return str(text).strip()
