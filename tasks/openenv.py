"""OpenEnv environments as tasks, driven through openenv-core's own session client (WebSocket).

    task:
      name: openenv
      params:
        app: examples.environments.guess_env:app   # rlops serves it: uvicorn on 127.0.0.1, a free port
        # or: url: http://127.0.0.1:8765            # a server that is already running
        max_turns: 6
        reset: {}                # keyword arguments for every reset (besides the seed)
        train_seeds: [0, 1000]   # [start, stop): one prompt per seed
        eval_seeds: [1000000, 1000064]
        action: tool             # or text: the reply's text is the Action's one string field
        step_timeout_s: 30
        reward: sum              # the `env` reward: sum of the step rewards, or the last

An episode runs in a session of its own (`openenv.core.generic_client.GenericEnvClient` over `/ws`;
the HTTP `/reset` and `/step` are stateless, a fresh environment per call, so they cannot play an
episode), played by tasks/environment.py's driver: the observation after `reset(seed=...)` is the
prompt, each turn's action is a call of a tool whose parameters are the Action's JSON schema from
`/schema` (its `metadata` field left out), each observation comes back as the tool's result.

An environment with MCP tools (openenv-core's `MCPEnvironment`, RFC 003: its Action is `CallToolAction`)
offers those instead: `make_task` lists them (a `list_tools` step), the model calls any of them, each
call is a `call_tool` step whose result (or tool error) is the tool message, with the step's reward
and `done` stored as for any step. The tool list's schemas are part of the identity.

Before any compute (`make_task`, the config check, the rollout stage): the server must answer
`/health`, `/schema` and `/metadata` (an unreachable url is a clear error), `action: text` needs an
Action with one string field, and `check_sessions` opens as many sessions as a shard runs at once
(groups x G): a server whose `max_concurrent_envs` is smaller is named with both numbers.

A server rlops starts (`app`) is one process per app per rlops process, stopped when rlops exits
(and by the kernel if rlops is killed: parent-death signal); when it has died, the next episode
starts it again. Episodes in flight when it dies become error rows naming the step.

Identity (in every prompt's metadata, so in the rollout batch id and every row): openenv-core's
version, the app's module source hash (app) or nothing of the address (url), the server's
`/metadata` and `/schema`, and the task's driving config (max_turns, reset, action, reward).
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import importlib.util
import json
import os
import signal
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any, Literal

from tasks.base import Task
from tasks.environment import (EVAL_SEEDS, TRAIN_SEEDS, DriverConfig, StepOutcome, action_parameters, check_seeds,
                               env_task, text_field)

START_TIMEOUT_S = 60.0  # a server's first start imports openenv-core (gradio, fastmcp): seconds on a loaded machine
PROBE_WAIT_S = 0.5  # how long a probed session waits to be refused: the server refuses right after accepting
SYSTEM_PROMPT = ("You act in an environment. Each turn, take one action with the {tool} tool; the environment "
                 "answers with what happened.")
SYSTEM_PROMPT_TEXT = "You act in an environment. Each turn, reply with your action only."


def make_task(app: str | None = None, url: str | None = None, max_turns: int = 8, reset: dict[str, Any] | None = None,
              train_seeds: list[int] = list(TRAIN_SEEDS), eval_seeds: list[int] = list(EVAL_SEEDS),
              action: Literal["tool", "text"] = "tool", step_timeout_s: float = 30.0,
              reward: Literal["sum", "last"] = "sum", system_prompt: str | None = None,
              max_error_frac: float = 0.25) -> Task:
    """An OpenEnv environment as a task (module docstring). `system_prompt` replaces the default
    instructions; `max_error_frac` is the share of a shard's episodes that may fail (a dead server,
    a slow step) before the stage fails."""
    if (app is None) == (url is None):
        raise ValueError("task.params: give either 'app' (\"module:attr\", rlops serves it) or 'url' (a running server)")
    if max_turns < 1 or step_timeout_s <= 0:
        raise ValueError("task.params: max_turns must be >= 1 and step_timeout_s > 0")
    train, held_out = check_seeds(train_seeds, eval_seeds)
    server = served(app) if app is not None else None
    base = server.ensure_running() if server is not None else url.rstrip("/")  # started again if it died
    info = describe_server(base)
    schema = action_parameters(info["schema"]["action"])
    mcp = is_mcp(info["schema"]["action"])
    tools = list_mcp_tools(base, step_timeout_s) if mcp else ()
    if mcp and action == "text":
        raise ValueError(f"action: text takes the reply's text as an Action's one string field; the environment at "
                         f"{app or url} acts through its MCP tools ({', '.join(t['function']['name'] for t in tools)}): "
                         "use action: tool")
    name = f"openenv {info['metadata'].get('name') or app or url}"
    config = DriverConfig(
        name=f"{name} ({app or url})", max_turns=max_turns, action_schema=schema, action=action,
        step_timeout_s=step_timeout_s,
        # Opening a session restarts a served app that died: its start (imports) is not the step's time.
        open_timeout_s=step_timeout_s + START_TIMEOUT_S if app else None, tools=tools,
        system_prompt=system_prompt or (SYSTEM_PROMPT_TEXT if action == "text" else SYSTEM_PROMPT.format(tool="act")))
    if action == "text":
        text_field(schema)  # ValueError now, not at the first episode
    identity = {"source": "openenv", "openenv_core": package_version("openenv-core"),
                "app": app, "app_source": _module_digest(app) if app else None,
                "server": info["metadata"], "schema": _digest(info["schema"]), "tools": _digest(tools) if mcp else None,
                "config": {"max_turns": max_turns, "reset": reset or {}, "action": action, "reward": reward}}
    observation_schema = info["schema"]["observation"]

    async def open_session() -> OpenEnvSession:
        where = await asyncio.to_thread(server.ensure_running) if server is not None else base
        return await OpenEnvSession.open(where, reset or {}, observation_schema, step_timeout_s, mcp=mcp)

    return env_task(name="openenv", identity=identity, config=config, train_seeds=train, eval_seeds=held_out,
                    open_session=open_session, max_error_frac=max_error_frac,
                    check_sessions=lambda n: check_sessions(server.ensure_running() if server else base, n, step_timeout_s),
                    episode_timeout=step_timeout_s * (2 * max_turns + 2) + 60.0 + (START_TIMEOUT_S if app else 0.0))


class OpenEnvSession:
    """One episode's WebSocket session (openenv-core's GenericEnvClient); observations are validated
    against the server's observation schema and rendered as text."""

    def __init__(self, client: Any, reset_kwargs: dict[str, Any], observation_schema: dict[str, Any],
                 mcp: bool = False) -> None:
        self.client, self.reset_kwargs, self.mcp = client, reset_kwargs, mcp
        import jsonschema

        self.validator = jsonschema.Draft202012Validator(_without_bookkeeping(observation_schema))

    @classmethod
    async def open(cls, url: str, reset_kwargs: dict[str, Any], observation_schema: dict[str, Any],
                   timeout: float, mcp: bool = False) -> OpenEnvSession:
        client = _client_class()(base_url=url, connect_timeout_s=timeout, message_timeout_s=timeout)
        await client.connect()
        return cls(client, reset_kwargs, observation_schema, mcp)

    async def reset(self, seed: int) -> StepOutcome:
        # An MCP environment's schema is CallToolObservation's: its reset answers with an observation of its own.
        return self._outcome(await self.client.reset(seed=seed, **self.reset_kwargs), validate=not self.mcp)

    async def step(self, action: dict[str, Any]) -> StepOutcome:
        return self._outcome(await self.client.step({"type": "call_tool", **action} if self.mcp else action))

    async def close(self) -> None:
        await self.client.disconnect()

    def _outcome(self, result: Any, validate: bool = True) -> StepOutcome:
        problems = sorted(self.validator.iter_errors(result.observation), key=lambda e: list(e.path)) if validate else []
        if problems:
            raise ValueError(f"the observation does not validate against the server's schema: {problems[0].message} "
                             f"(at {'/'.join(map(str, problems[0].path)) or 'the top'}): {json.dumps(result.observation)[:300]}")
        reward = None if result.reward is None else float(result.reward)
        text = tool_result_text(result.observation) if self.mcp and validate else observation_text(result.observation)
        return StepOutcome(text, reward, bool(result.done))


def observation_text(observation: dict[str, Any]) -> str:
    """What the model reads: the one string field of an observation that has one, else its JSON."""
    if len(observation) == 1 and isinstance(next(iter(observation.values())), str):
        return next(iter(observation.values()))
    return json.dumps(observation, ensure_ascii=False)


def tool_result_text(observation: dict[str, Any]) -> str:
    """What the model reads of a `call_tool` step: the tool's error, or its result (FastMCP's `data`,
    else the text of its content blocks, else the JSON)."""
    if observation.get("error"):
        error = observation["error"]
        return f"error ({error.get('error_type', 'error')}): {error.get('message', '')}"
    result = observation.get("result")
    if isinstance(result, dict):
        if result.get("data") is not None:
            result = result["data"]
        elif result.get("content"):
            return "\n".join(block.get("text", "") for block in result["content"] if isinstance(block, dict))
    return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)


def is_mcp(action_schema: dict[str, Any]) -> bool:
    """Whether a server's Action is openenv-core's `CallToolAction` (an `MCPEnvironment`)."""
    kind = action_schema.get("properties", {}).get("type", {})
    return action_schema.get("title") == "CallToolAction" or kind.get("const") == "call_tool"


def _client_class() -> Any:
    """openenv-core's `GenericEnvClient`. Its package imports the server side too, Gradio web interface and all
    (~2 s of CPU a process); a client never serves that interface, so it comes without it (tasks/openenv_app.py)."""
    from tasks.openenv_app import env_server_without_gradio

    env_server_without_gradio()
    from openenv.core.generic_client import GenericEnvClient

    return GenericEnvClient


def list_mcp_tools(url: str, timeout: float) -> tuple[dict[str, Any], ...]:
    """The MCP tools of the environment at `url` (a `list_tools` step in a session of its own), as
    OpenAI function tools; a ValueError when it lists none."""
    async def listed() -> list[dict[str, Any]]:
        client = _client_class()(base_url=url, connect_timeout_s=timeout, message_timeout_s=timeout)
        await client.connect()
        try:
            return (await client.step({"type": "list_tools"})).observation.get("tools") or []
        finally:
            await client.disconnect()

    with ThreadPoolExecutor(1) as pool:  # asyncio.run refuses to nest in a caller's running loop
        tools = pool.submit(asyncio.run, listed()).result()
    if not tools:
        raise ValueError(f"the OpenEnv server at {url} takes MCP tool calls (CallToolAction) but lists no tools")
    return tuple({"type": "function", "function": {"name": t["name"], "description": t.get("description") or t["name"],
                                                   "parameters": t.get("input_schema") or {"type": "object"}}}
                 for t in tools)


def _without_bookkeeping(schema: dict[str, Any]) -> dict[str, Any]:
    """The observation schema of what the client receives: openenv-core sends done, reward and
    metadata beside the observation, not in it."""
    drop = {"done", "reward", "metadata"}
    return {**schema, "properties": {k: v for k, v in schema.get("properties", {}).items() if k not in drop},
            "required": [r for r in schema.get("required", []) if r not in drop]}


def describe_server(url: str, timeout: float = 10.0) -> dict[str, Any]:
    """{"metadata": GET /metadata, "schema": GET /schema} of a running server; a ValueError saying what
    is wrong when it cannot be reached or does not speak OpenEnv."""
    import httpx

    out = {}
    for key, path in (("health", "/health"), ("metadata", "/metadata"), ("schema", "/schema")):
        try:
            response = httpx.get(url + path, timeout=timeout)
        except httpx.HTTPError as e:
            raise ValueError(f"cannot reach the OpenEnv server at {url}: {type(e).__name__}: {e}") from e
        if response.status_code != 200:
            raise ValueError(f"the OpenEnv server at {url} answered GET {path} with HTTP {response.status_code}: "
                             "is it an openenv-core app?")
        out[key] = response.json()
    if not isinstance(out["schema"].get("action"), dict) or not isinstance(out["schema"].get("observation"), dict):
        raise ValueError(f"the OpenEnv server at {url} has no action/observation schema at /schema")
    return out


def check_sessions(url: str, needed: int, timeout: float) -> None:
    """Open `needed` WebSocket sessions at once; ValueError naming both numbers when the server refuses
    some (openenv-core's CAPACITY_REACHED: `max_concurrent_envs` is smaller)."""
    async def probe() -> list[dict[str, Any]]:
        from websockets.asyncio.client import connect

        base = "ws" + url[len("http"):] if url.startswith("http") else url

        async def one() -> dict[str, Any]:
            async with connect(f"{base}/ws", open_timeout=timeout) as ws:
                # A refused session is told at once (then closed); an accepted one hears nothing until it
                # speaks, and is held open meanwhile, so all `needed` are open together.
                try:
                    return json.loads(await asyncio.wait_for(ws.recv(), PROBE_WAIT_S))
                except asyncio.TimeoutError:
                    return {}

        return await asyncio.gather(*(one() for _ in range(needed)))

    with ThreadPoolExecutor(1) as pool:  # asyncio.run refuses to nest in a caller's running loop
        replies = pool.submit(asyncio.run, probe()).result()
    refused = [r["data"] for r in replies if r.get("type") == "error" and r["data"].get("code") == "CAPACITY_REACHED"]
    if refused:
        held = refused[0].get("max_sessions", needed - len(refused))
        raise ValueError(f"the OpenEnv server at {url} holds {held} concurrent sessions, but a shard runs {needed} "
                         f"episodes at once (rollout.groups_per_shard x group_size; {len(refused)} were refused): "
                         "raise the server's max_concurrent_envs or lower them")


class AppServer:
    """An OpenEnv app ("module:attr") served by uvicorn in a child process on 127.0.0.1 (tasks/openenv_app.py)."""

    def __init__(self, app: str) -> None:
        self.app = app
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.log = Path(tempfile.mkdtemp(prefix="rlops-openenv-")) / "server.log"
        self.lock = threading.Lock()
        # Popen from one long-lived thread: the parent-death signal fires when the *thread* that started
        # the child ends, so a child started from a shard's short-lived event loop thread would die with it.
        self.spawner = ThreadPoolExecutor(1, thread_name_prefix="rlops-openenv-spawn")

    def ensure_running(self) -> str:
        """The server's URL, starting it (again) when it is not running."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.spawner.submit(self._start).result()
            return self.url

    def _start(self) -> None:
        port = _free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tasks.openenv_app", self.app, "--host", "127.0.0.1", "--port", str(port),
                 "--log-level", "warning"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, preexec_fn=_die_with_parent)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers(self.url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log.read_text(errors="replace")[-1500:]
                raise ValueError(f"the OpenEnv app {self.app!r} did not start on {self.url} (it must be importable from "
                                 f"{os.getcwd()} or installed); its log ends: {tail}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_SERVERS: dict[str, AppServer] = {}


def served(app: str) -> AppServer:
    """The running server of `app` in this process (started on first use, stopped at exit)."""
    if app not in _SERVERS:
        server = AppServer(app)
        server.ensure_running()
        _SERVERS[app] = server
    return _SERVERS[app]


@atexit.register
def _stop_all() -> None:
    for server in _SERVERS.values():
        server.stop()
        shutil.rmtree(server.log.parent, ignore_errors=True)  # its log's folder: nothing is left in the temp dir


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the thread that started it (and so rlops) is gone."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _module_digest(app: str) -> str | None:
    """16 hex digits of the app module's source: editing the environment makes new rollouts."""
    sys.path.insert(0, os.getcwd())  # where uvicorn imports it from
    try:
        spec = importlib.util.find_spec(app.partition(":")[0])
    except ModuleNotFoundError:
        spec = None
    finally:
        sys.path.remove(os.getcwd())
    if spec is None or not spec.origin or not Path(spec.origin).is_file():
        return None
    return hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()[:16]


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]
