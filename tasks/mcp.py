"""Tasks whose tools come from an MCP server (the official `mcp` SDK), over stdio or streamable HTTP.

    task:
      name: mcp
      params:
        server: {command: [python, examples/doc_search_mcp/server.py], env: {K: V}}   # stdio
        # server: {url: "http://127.0.0.1:8765/mcp"}                                 # streamable HTTP
        base: doc_search                      # prompts, system prompt, turn limit, ground truth
        base_params: {n_train: 32}
        # or: prompts: FILE (JSONL as tasks/agent.py reads it) + system_prompt + max_turns

The tool list is read from the server (`list_tools`) when the task is built: each MCP tool becomes an
OpenAI function schema in `Task.tool_specs` (its `inputSchema` as the parameters), so the system
prompt lists it like a built-in tool and the schemas enter the rollout batch id through
`tasks.base.content_digest`: a server whose tools change makes new rollouts. A call runs on the
server; its text content is the tool message. An `is_error` result, a transport failure or a call
over `call_timeout` raises `McpToolError`, which the agent loop records as an `error: ...` tool
message, like a built-in tool that raises. A server that cannot be started or listed fails
`make_task`, so a config naming one is refused before any compute.

The built-in agent loop calls tools as sync `fn(**arguments) -> str` from threads; the MCP client is
async. Each server gets one `McpConnection`: an event loop thread holding the client session, shared
by every task built for that server in this process (rollout workers, evaluation and config checks
load the task again; a stdio server is started once). A stdio server is a child process reading our
stdin pipe: it ends with the connection's close (at exit) or, if this process dies, when the pipe
closes (an MCP stdio server exits at end of input). Its stderr (the SDK logs every request at INFO
there) goes to the `tasks.mcp` logger line by line, which a run writes to its log file
(flows/console.py), not to the console.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import importlib
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from storage.ids import canonical_json
from tasks.base import Prompt, Task, load_task, write_chat_jsonl

# A stdio server's first start imports its SDK and its own code: seconds on a loaded machine.
START_TIMEOUT_S = 60.0
log = logging.getLogger(__name__)


class McpToolError(RuntimeError):
    """A tool call the server answered with `is_error`, or one that failed on the way (the message says which)."""


class StderrToLog:
    """A pipe for a stdio server's stderr: a thread logs each line to `tasks.mcp` at INFO until the
    server and this side (`close`) have both closed their ends."""

    def __init__(self, server: str) -> None:
        read_fd, write_fd = os.pipe()
        self.stream = os.fdopen(write_fd, "w")  # what the SDK hands the subprocess as its stderr
        self._thread = threading.Thread(target=self._pump, args=(os.fdopen(read_fd, errors="replace"), server),
                                        name="mcp-stderr", daemon=True)
        self._thread.start()

    @staticmethod
    def _pump(lines: Any, server: str) -> None:
        with lines:
            for line in lines:
                log.info("%s: %s", server, line.rstrip("\n"))

    def close(self) -> None:
        """Close this side's end; wait (bounded) for the server's last lines to be logged."""
        self.stream.close()
        self._thread.join(5.0)


class McpConnection:
    """One MCP client session, held open by a coroutine on an event loop thread of its own."""

    def __init__(self, server: dict[str, Any], start_timeout: float = START_TIMEOUT_S) -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="mcp-client", daemon=True)
        self.thread.start()
        self.client: Any = None
        self._stderr = StderrToLog(describe(server)) if "command" in server else None
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._stop: asyncio.Event | None = None
        self._held = asyncio.run_coroutine_threadsafe(self._hold(), self.loop)
        try:
            self._ready.result(start_timeout)
        except concurrent.futures.TimeoutError:
            self.close()
            raise ValueError(f"MCP server {describe(server)} did not answer within {start_timeout:g} s") from None
        except Exception as e:
            self.close()
            raise ValueError(f"cannot start or reach the MCP server {describe(server)}: {_reason(e)}") from e

    async def _hold(self) -> None:
        """Enter the client, signal ready, and stay inside it until `close` (anyio wants one task for both)."""
        from mcp import Client

        self._stop = asyncio.Event()
        try:
            async with Client(_target(self.server, self._stderr)) as client:
                self.client = client
                self._ready.set_result(None)
                await self._stop.wait()
        except BaseException as e:  # noqa: BLE001 - a failed start is reported by __init__
            if not self._ready.done():
                self._ready.set_exception(e)
            raise

    @property
    def alive(self) -> bool:
        return not self._held.done()

    def run(self, coro: Any, timeout: float) -> Any:
        """Run a coroutine on the connection's loop; wait at most `timeout` seconds for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def tool_specs(self, timeout: float = START_TIMEOUT_S) -> list[dict[str, Any]]:
        """Every tool of the server (all pages) as an OpenAI function schema, in the server's order."""
        async def all_tools() -> list[Any]:
            tools, cursor = [], None
            while True:
                page = await self.client.list_tools(cursor=cursor, cache_mode="refresh")
                tools += page.tools
                cursor = page.next_cursor
                if not cursor:
                    return tools

        return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                  "parameters": t.input_schema}} for t in self.run(all_tools(), timeout)]

    def call(self, name: str, arguments: dict[str, Any], timeout: float) -> str:
        """The text of a tool call's result; raises McpToolError on `is_error`, a failed transport or the timeout."""
        try:
            result = self.run(self.client.call_tool(name, arguments, read_timeout_seconds=timeout), timeout + 1.0)
        except concurrent.futures.TimeoutError:
            raise McpToolError(f"the MCP server did not answer within {timeout:g} s") from None
        except Exception as e:  # noqa: BLE001 - a transport or protocol failure is the call's error
            raise McpToolError(f"the call to the MCP server failed: {_reason(e)}") from e
        text = result_text(result)
        if result.is_error:
            raise McpToolError(text or "the server reported an error without a message")
        return text

    def close(self) -> None:
        """Leave the session (a stdio server gets end of input and is stopped), then stop the loop."""
        if self._stop is not None and self.alive:
            self.loop.call_soon_threadsafe(self._stop.set)
            try:
                self._held.result(15.0)
            except BaseException:  # noqa: BLE001 - closing: how the session ended does not matter
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5.0)
        if self._stderr is not None:
            self._stderr.close()


def result_text(result: Any) -> str:
    """A CallToolResult as the tool message's text: its text parts joined by newlines; other parts
    named by type; the structured content as JSON when there is no content at all."""
    parts = [c.text if getattr(c, "type", "") == "text" else f"[{getattr(c, 'type', 'unknown')} content]"
             for c in result.content or []]
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    return "\n".join(parts)


_CONNECTIONS: dict[str, McpConnection] = {}
_LOCK = threading.Lock()


def connect(server: dict[str, Any]) -> McpConnection:
    """The process's connection to `server` (started on first use; restarted if its session ended)."""
    key = canonical_json(server)
    with _LOCK:
        conn = _CONNECTIONS.get(key)
        if conn is None or not conn.alive:
            if conn is not None:  # its session ended: stop its loop thread and stderr pipe
                conn.close()
            conn = _CONNECTIONS[key] = McpConnection(server)
        return conn


@atexit.register
def close_all() -> None:
    """Close every connection of this process (stdio servers stop)."""
    with _LOCK:
        conns = list(_CONNECTIONS.values())
        _CONNECTIONS.clear()
    for conn in conns:
        conn.close()


def check_server(server: dict[str, Any]) -> dict[str, Any]:
    """`server` normalised to {command: [...], env, cwd} or {url}; a clear ValueError otherwise.
    A command `python` runs the interpreter running rlops (its environment has `mcp` and rlops)."""
    keys = set(server)
    if ("url" in keys) == ("command" in keys):
        raise ValueError("task.params.server needs either 'url' (streamable HTTP) or 'command' (stdio), not both")
    if "url" in keys:
        if keys != {"url"} or not isinstance(server["url"], str) or not server["url"].startswith(("http://", "https://")):
            raise ValueError(f"task.params.server: a streamable HTTP server is {{url: http://HOST:PORT/mcp}}, got {server!r}")
        return {"url": server["url"]}
    unknown = keys - {"command", "args", "env", "cwd"}
    if unknown:
        raise ValueError(f"task.params.server: unknown keys {sorted(unknown)} (stdio takes command, args, env, cwd)")
    command = server["command"]
    command = [command] if isinstance(command, str) else command
    args = server.get("args", [])
    env = server.get("env") or {}
    if not (isinstance(command, list) and command and all(isinstance(a, str) for a in command + list(args))):
        raise ValueError(f"task.params.server.command: a program and its arguments (strings), got {server['command']!r}")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ValueError("task.params.server.env: a mapping of strings to strings")
    out: dict[str, Any] = {"command": command + list(args), "env": env}
    if server.get("cwd") is not None:
        out["cwd"] = str(server["cwd"])
    return out


def describe(server: dict[str, Any]) -> str:
    return server["url"] if "url" in server else " ".join(server["command"])


def _target(server: dict[str, Any], stderr: StderrToLog | None) -> Any:
    """What `mcp.Client` connects to: the URL, or a stdio transport (env merged over the SDK's default
    environment, which passes PATH and HOME but not the rest of ours; stderr into `stderr`'s pipe)."""
    if "url" in server:
        return server["url"]
    from mcp import StdioServerParameters
    from mcp.client.stdio import stdio_client

    command, *args = server["command"]
    command = sys.executable if command == "python" else command  # rlops's own interpreter, whatever PATH says
    params = StdioServerParameters(command=command, args=args, env=server["env"] or None, cwd=server.get("cwd"))
    return stdio_client(params, errlog=stderr.stream)


def _reason(e: BaseException) -> str:
    """The innermost useful message of an exception (anyio wraps failures in exception groups)."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return f"{type(e).__name__}: {e}"


def make_tool(conn: McpConnection, name: str, timeout: float) -> Callable[..., str]:
    """The sync `fn(**arguments) -> str` the agent loop calls for the server's tool `name`."""
    def tool(**arguments: Any) -> str:
        return conn.call(name, arguments, timeout)

    tool.__name__ = name
    return tool


def make_task(server: dict[str, Any], base: str | None = None, base_params: dict[str, Any] | None = None,
              prompts: str | None = None, system_prompt: str = "", max_turns: int | None = None,
              name: str = "mcp", call_timeout: float = 30.0) -> Task:
    """A task whose tools are the MCP `server`'s: {command: [...], args, env, cwd} (stdio) or {url} (streamable HTTP).

    The prompts, system prompt, turn limit and ground truth come from a `base` task (built with
    `base_params`; its own tools are dropped) or from a `prompts` JSONL file with `system_prompt`;
    `max_turns` overrides the base's (default 4 with a prompts file: search, read, answer and one spare).
    `name` goes into the rollouts' `task` column; `call_timeout` bounds one tool call on the server (seconds).
    """
    if (base is None) == (prompts is None):
        raise ValueError("task.params: give either 'base' (a task to take prompts from) or 'prompts' (a JSONL file)")
    if call_timeout <= 0:
        raise ValueError(f"task.params.call_timeout must be > 0, got {call_timeout}")
    spec = check_server(server)
    if base is not None:
        if base == "mcp":
            raise ValueError("task.params.base: an MCP task cannot be its own base")
        inner = load_task(base, base_params)
        system, by_split, turns = system_prompt or inner.system_prompt, inner.prompts, inner.max_turns
    else:
        from tasks.agent import read_prompts

        path = Path(prompts).expanduser().resolve()
        if not path.exists():
            raise ValueError(f"prompts file not found: {path}")
        splits = read_prompts(path)
        system, turns = system_prompt, 4

        def by_split(split: str) -> list[Prompt]:
            return list(splits.get(split, []))

    conn = connect(spec)
    try:
        specs = conn.tool_specs()
    except Exception as e:  # noqa: BLE001 - a server that cannot list its tools is a config error
        raise ValueError(f"cannot list the tools of the MCP server {describe(spec)}: {_reason(e)}") from e
    if not specs:
        raise ValueError(f"the MCP server {describe(spec)} lists no tools")
    tools = {s["function"]["name"]: make_tool(conn, s["function"]["name"], call_timeout) for s in specs}
    return Task(name=name, system_prompt=system, prompts=by_split, tools=tools, tool_specs=specs,
                max_turns=max_turns if max_turns is not None else turns)


def write_oracle_dataset(path: str | Path, split: str = "train", n: int | None = None, **params: Any) -> int:
    """SFT demonstrations (`sft.data: oracle`): the base task's scripted episodes (its `oracle_messages`)
    with the tool results served by the MCP server; returns the number of lines written."""
    task = make_task(**params)
    base = params.get("base")
    module = importlib.import_module(f"tasks.{base}" if base and "." not in base else base) if base else None
    if module is None or not hasattr(module, "oracle_messages"):
        raise ValueError(f"the base task {base!r} has no oracle_messages(task, prompt): give sft.data a file")
    rows = ({"messages": module.oracle_messages(task, p), "tools": task.tool_specs} for p in task.prompts(split)[:n])
    return write_chat_jsonl(path, rows)
