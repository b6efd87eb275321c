"""External agent tasks: an agent written against an OpenAI-compatible client, trained unchanged.

    task:
      name: agent
      params:
        entry: examples/doc_search_openai/agent.py:rollout   # or package.module:rollout
        # or: url: http://127.0.0.1:8300/rollout            # an agent service, any process or language
        prompts: examples/doc_search_openai/prompts.jsonl

The entry takes one of two forms, with no rlops import needed:

    async def rollout(client: openai.AsyncOpenAI, model: str, prompt: str) -> dict | list | None
    async def rollout(endpoint: Endpoint, prompt: str) -> ...     # or a plain `def` (run in a thread)

The second form is chosen by the first parameter's name `endpoint` or its annotation `Endpoint`: an
`Endpoint` holds what a framework that builds its own client needs (`base_url`, the episode's own
`/ep/{episode_id}/v1` URL, so a bare base URL suffices; `api_key`; `headers` with X-Episode-Id;
`model`; `episode_id`) and makes openai clients (`async_client()`, `sync_client()`). A `def` entry
(smolagents, a sync LangChain agent) runs in a thread of its own per episode, under the same timeout
(an overrunning thread cannot be stopped: it is abandoned, its later calls refused once the shard ends).

The rollout stage serves the policy being trained (stages/service/service.py, on 127.0.0.1) and calls it G
times per prompt, concurrently, with a client whose every request is recorded under that episode;
the agent must pass `model` on as the request's `model`. Its result may be
  - a dict with `messages` (the final conversation: OpenAI message dicts, the client's message
    objects, or a framework's own history, see tasks/histories.py) and/or `metadata` (a dict of
    fields for the rewards, added to the prompt's metadata),
  - a list (the final conversation), a framework's result object (an Agents SDK RunResult), or
  - None: the service's record of the episode's last call is the conversation.
An agent that raises or times out becomes an error row (finish_reason "error", no tokens, the
error in metadata["error"]), and so does an episode with no call recorded under it (the reason
says what the service saw instead: requests without an episode id, unknown model names); the stage
fails only when more than `max_error_frac` of a shard's episodes are errors.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from storage.settings import no_telemetry
from tasks.base import AgentSpec, Prompt, Task

EPISODE_HEADER = "X-Episode-Id"  # the header the policy service files a call under (stages/service/app.py)


@dataclass(frozen=True)
class Endpoint:
    """Where one episode's agent reaches the policy being trained: any OpenAI-compatible client works
    with `base_url` + `api_key` (+ `headers`, redundant with the episode URL but harmless) + `model`."""

    base_url: str  # http://127.0.0.1:PORT/ep/{episode_id}/v1: the URL alone files every call under the episode
    model: str  # the policy's name: every request's `model`
    episode_id: str
    api_key: str = "rlops-local"  # unchecked; clients insist on one
    headers: dict[str, str] = field(default_factory=dict)  # {"X-Episode-Id": episode_id}
    timeout: float = 600.0  # the episode's timeout, a sensible client timeout too

    def async_client(self, **kwargs: Any) -> Any:
        """An `openai.AsyncOpenAI` on the endpoint (no retries: a refused call is the agent's to see)."""
        import openai

        return openai.AsyncOpenAI(**self._client_args(kwargs))

    def sync_client(self, **kwargs: Any) -> Any:
        """An `openai.OpenAI` on the endpoint."""
        import openai

        return openai.OpenAI(**self._client_args(kwargs))

    def _client_args(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {"base_url": self.base_url, "api_key": self.api_key, "default_headers": dict(self.headers),
                "max_retries": 0, "timeout": self.timeout, **kwargs}


def entry_form(fn: Any, entry: str) -> str:
    """"client" for `async def f(client, model, prompt)`, "endpoint" for `[async] def f(endpoint: Endpoint,
    prompt)`; any other signature is a ValueError saying what fits, raised when the task is built."""
    name = getattr(fn, "__name__", "rollout")
    forms = (f"`async def {name}(client, model, prompt)` or `[async] def {name}(endpoint: Endpoint, prompt)`")
    if not callable(fn) or inspect.isclass(fn):
        raise ValueError(f"{entry!r} must name a function: {forms}")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as e:
        raise ValueError(f"{entry!r}: cannot read its signature ({e}); it must be {forms}") from e
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    first = positional[0] if positional else None
    annotation = getattr(first, "annotation", None)
    endpoint = first is not None and (first.name == "endpoint" or annotation is Endpoint
                                      or (isinstance(annotation, str) and annotation.split(".")[-1] == "Endpoint"))
    if endpoint and len(positional) >= 2 and len(required) <= 2:
        return "endpoint"
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"{entry!r} must be {forms}; a plain `def` entry takes the endpoint form")
    if len(positional) >= 3 and len(required) <= 3 and not endpoint:
        return "client"
    raise ValueError(f"{entry!r} has the signature {name}{inspect.signature(fn)}; it must be {forms}")


def load_entry(entry: str) -> tuple[Callable[..., Any], Path]:
    """The entry function named by "package.module:fn" or "path/to/file.py:fn", and its source file;
    its signature is checked (`entry_form`). The libraries' phoning home is switched off before the
    agent's module (and the frameworks it imports) loads."""
    no_telemetry()
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
    if fn is None:
        raise ValueError(f"{entry!r}: the module has no {name!r}; it must define `async def {name}(client, model, "
                         f"prompt)` or `[async] def {name}(endpoint: Endpoint, prompt)`")
    entry_form(fn, entry)
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

    def by_split(split: str) -> list[Prompt]:
        return list(splits.get(split, []))

    return Task(name=name, system_prompt="", prompts=by_split,
                agent=agent_spec(entry, url, version, path.read_bytes(), max_error_frac, episode_timeout))


def agent_spec(entry: str | None, url: str | None, version: str | None, data: bytes, max_error_frac: float,
               episode_timeout: float) -> AgentSpec:
    """How the rollout stage runs the agent an `entry` or a `url` names; its version hashes the agent's code (or the
    service's version) with `data`, what its prompts are read from (a prompts file, the traffic task's scenarios)."""
    if (entry is None) == (url is None):
        raise ValueError("task.params: give either 'entry' (a coroutine function) or 'url' (an agent service)")
    if entry is not None:
        if version is not None:
            raise ValueError("task.params.version is for an agent service (url); an entry's version is its source's hash")
        fn, source = load_entry(entry)
        form = entry_form(fn, entry)
        agent_code = source.read_bytes()
    else:
        fn, entry, form = None, "", "client"
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"task.params.url: an http(s) URL of the agent service's rollout endpoint, got {url!r}")
        agent_code = b"service:" + (version if version is not None else service_version(url)).encode()
    version_hash = hashlib.sha256(agent_code + b"\0" + data).hexdigest()[:16]
    return AgentSpec(entry, fn, version_hash, max_error_frac, episode_timeout, url=url, form=form)


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
