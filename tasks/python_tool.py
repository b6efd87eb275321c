"""The `python` tool: an agent runs a program in the sandbox (sandbox/) and reads what it printed.

    task: {name: dataset, params: {path: data/code.jsonl, python_tool: true, max_turns: 4}}

The model calls it as any rlops tool (docs/TASKS.md):

    <tool_call>{"name": "python", "arguments": {"code": "print(sum(range(10)))"}}</tool_call>

and the next message is a tool result: the program's output, then its error (the traceback's last lines) and how it
ended when it did not finish (timeout, memory, crash, output). Each call is a fresh execution: no network, no file
kept, nothing of the run reachable; a call's limits fit inside the rollout's `tool_timeout` (10 s by default).
"""

from __future__ import annotations

from typing import Any

from sandbox import Limits, shared_pool

LIMITS = Limits(wall_seconds=8.0, test_seconds=8.0, cpu_seconds=8, output_chars=16_384)
MAX_CHARS = 4000  # of a result shown to the model: its context is short
SPEC: dict[str, Any] = {"type": "function", "function": {
    "name": "python",
    "description": "Run a Python program and see what it prints (no network, no files kept, 8 s).",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                   "required": ["code"]}}}


def python(code: str) -> str:
    """Run `code` in a fresh sandboxed execution; its output, error and ending, as text for the model."""
    result = shared_pool().run(code, LIMITS)
    parts = [result.stdout.rstrip()]
    if result.error:
        parts.append(result.error.rstrip())
    if result.outcome not in ("pass", "fail"):
        parts.append(f"[{result.outcome}]")
    text = "\n".join(p for p in parts if p) or "(no output)"
    return text if len(text) <= MAX_CHARS else text[: MAX_CHARS - 20] + "\n... (output cut)"
