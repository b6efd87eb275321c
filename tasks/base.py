"""What a task is: prompts (dataset), system prompt, tools, turn limit, ground truth.

A task is a plain `Task` value built by a module-level `make_task(**params)`.
Built-in tasks are named by their module (`arithmetic`, `doc_search`); a
user-defined task is any importable module path with the same function
(`task: {name: mypkg.mytask, params: {...}}` in a config).

Tool calls follow the format the system prompt teaches the model:

    <tool_call>{"name": "search", "arguments": {"query": "..."}}</tool_call>

An assistant turn with no tool call is the final answer.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any, Callable, Iterable, Sequence

from storage.atomic import atomic_file
from storage.ids import canonical_json
from storage.images import data_url
from storage.schema import ToolCall

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
OPEN_TAG = "<tool_call>"


@dataclass(frozen=True)
class Prompt:
    """One task instance. `prompt_id` is stable: the same prompt has the same id in every run."""

    prompt_id: str
    question: str  # the user message
    metadata: dict[str, Any]  # ground truth and task fields, stored in rollouts.metadata
    # The whole opening conversation when the data gives one (a conversational dataset row, tasks/dataset.py):
    # used as it is instead of the task's system prompt + `question`, which is then its last user message.
    messages: tuple[dict[str, Any], ...] | None = None


@dataclass(frozen=True)
class AgentSpec:
    """How the rollout stage runs an external agent (built by tasks/agent.py)."""

    entry: str  # "module:fn" or "file.py:fn"; "" for an agent service (`url`)
    fn: Callable[..., Any] | None  # async def rollout(client, model, prompt); None for an agent service
    version: str  # hash of the entry's source file (or the service's version) and the prompts file: in the rollout batch id
    max_error_frac: float
    episode_timeout: float  # seconds per episode
    url: str | None = None  # an agent service (another process or language) that runs each episode on POST
    form: str = "client"  # fn(client, model, prompt), or "endpoint": fn(Endpoint, prompt), sync or async (tasks/agent.py)
    # or "prompt": async fn(Endpoint, Prompt), the whole prompt (an environment's seed, tasks/environment.py)
    # How many concurrent episodes the agent's backing resource holds: called with the number a group
    # needs before any compute; raises ValueError naming both numbers when it cannot (an environment server).
    check_sessions: Callable[[int], None] | None = None


@dataclass
class Task:
    name: str
    system_prompt: str
    # split ("train" | "test") -> prompts, in a stable order: a list, or a sequence read on demand from a large
    # file (tasks/dataset.py; `pick` takes many of its prompts in one read)
    prompts: Callable[[str], Sequence[Prompt]]
    tools: dict[str, Callable[..., str]] = field(default_factory=dict)  # name -> fn(**arguments) -> text
    tool_specs: list[dict[str, Any]] = field(default_factory=list)  # OpenAI function schemas
    max_turns: int = 1  # assistant turns per episode
    agent: AgentSpec | None = None  # an external agent (tasks/agent.py) runs the episodes through the policy service
    # What the prompts are read from, when that is a data file: its content hash (tasks.data_files.fingerprint),
    # part of every rollout batch id of the task, so edited data makes new rollouts. "" for generated prompts.
    data_version: str = ""
    # A visual task's images of a prompt (encoded PNG/JPEG bytes), shown after its question; None: text only.
    # Drawn from the prompt (its metadata) rather than stored in it, so rollouts.metadata stays small.
    images: Callable[[Prompt], list[bytes]] | None = None
    # Tools bound to one prompt (name -> fn(**arguments)), next to `tools` in its episodes: a visual task's zoom
    # crops that prompt's picture. A tool may return OpenAI content parts (text and image_url) instead of text.
    prompt_tools: Callable[[Prompt], dict[str, Callable[..., Any]]] | None = None
    # The prompts arrive while it is deployed (tasks/traffic.py: served conversations): an empty split is a night with
    # nothing to do (flows/nightly.py skips it), not a config error.
    live: bool = False

    def episode_tools(self, prompt: Prompt) -> dict[str, Callable[..., Any]]:
        """The tools an episode of `prompt` may call: the task's and the prompt's own (`prompt_tools`)."""
        return {**self.tools, **(self.prompt_tools(prompt) if self.prompt_tools is not None else {})}

    def messages(self, prompt: Prompt) -> list[dict[str, Any]]:
        """The opening messages of an episode: system (with tool instructions) + user. A visual task's user
        message is OpenAI content parts: the question's text part, then one `image_url` data URL per image.
        A prompt that carries its own opening conversation (`Prompt.messages`) opens with that."""
        if prompt.messages is not None:
            return [dict(m) for m in prompt.messages]
        return [
            {"role": "system", "content": render_system_prompt(self.system_prompt, self.tool_specs)},
            {"role": "user", "content": self.user_content(prompt)},
        ]

    def user_content(self, prompt: Prompt) -> str | list[dict[str, Any]]:
        """The user message's content: the question, with the prompt's images as content parts after it."""
        if self.images is None:
            return prompt.question
        return [{"type": "text", "text": prompt.question}] + [
            {"type": "image_url", "image_url": {"url": data_url(data)}} for data in self.images(prompt)]


def content_digest(task: Task, prompts: list[Prompt]) -> str:
    """16 hex digits of sha256 over what episodes of `prompts` start from and are judged against: the
    rendered system prompt (tool list included), the tool schemas, the turn limit, and each prompt's
    id, question, metadata (ground truth) and opening messages, a visual task's image bytes (so a change
    to how they are drawn is new content), and the task's `data_version` (its data file's hash). Part of
    the rollout batch id, so a data file whose rows change under the same prompt ids yields new rollouts. Tool *code* is not hashed (see ARCHITECTURE.md)."""
    payload = {"system": render_system_prompt(task.system_prompt, task.tool_specs), "tools": task.tool_specs,
               "max_turns": task.max_turns,
               "prompts": [[p.prompt_id, p.question, p.metadata] + ([list(p.messages)] if p.messages is not None else [])
                           for p in prompts]}
    if task.data_version:
        payload["data"] = task.data_version
    if task.images is not None:
        payload["images"] = [[hashlib.sha256(data).hexdigest() for data in task.images(p)] for p in prompts]
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:16]


def pick(prompts: Sequence[Prompt], positions: list[int]) -> list[Prompt]:
    """`prompts[i]` for each position, in one read where the sequence reads its rows on demand (`take`)."""
    take = getattr(prompts, "take", None)
    return take(positions) if take is not None else [prompts[i] for i in positions]


def render_system_prompt(system_prompt: str, tool_specs: list[dict[str, Any]]) -> str:
    """The system prompt plus the tool list and call format (small chat templates have no tool support)."""
    if not tool_specs:
        return system_prompt
    lines = [system_prompt, "", "You can call these tools:"]
    for spec in tool_specs:
        fn = spec["function"]
        params = ", ".join(fn.get("parameters", {}).get("properties", {}))
        lines.append(f"- {fn['name']}({params}): {fn.get('description', '')}")
    lines += [
        "",
        'To call a tool, reply with <tool_call>{"name": "TOOL", "arguments": {...}}</tool_call> and nothing else.',
        "When you know the answer, reply with the answer only.",
    ]
    return "\n".join(lines)


def parse_tool_calls(text: str, turn: int) -> list[ToolCall]:
    """Tool calls in an assistant message. The arguments are kept as written (possibly malformed JSON);
    `stages.policy.agent_loop.call_tools` reports what is wrong with them. An unclosed `<tool_call>` is read as one
    call from the rest of the text: a call when that is complete JSON (generation stopped at
    `</tool_call>`, which stop strings strip), a malformed call when it was cut off."""
    bodies = TOOL_CALL_RE.findall(text)
    if not bodies and OPEN_TAG in text:
        bodies = [text.split(OPEN_TAG, 1)[1]]
    calls = []
    for i, body in enumerate(bodies):
        name, arguments = "", body.strip()
        try:
            obj = json.loads(body)
            if isinstance(obj, dict):
                name = str(obj.get("name", ""))
                arguments = json.dumps(obj.get("arguments", {}))
        except json.JSONDecodeError:
            pass
        calls.append(ToolCall(id=f"call_{turn}_{i}", name=name, arguments=arguments))
    return calls


class TaskParamsError(ValueError):
    """Task params that do not fit `make_task`'s signature: one `task.params.<name>: ...` line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def load_task(name: str, params: dict[str, Any] | None = None) -> Task:
    """Build a task by built-in name (`arithmetic`, `doc_search`) or importable module path.

    The params are checked against `make_task`'s signature first (`check_params`), so a wrong type
    or an unknown name is a `TaskParamsError` naming the param, never a TypeError from inside the task.
    """
    module_name = f"tasks.{name}" if "." not in name else name
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"unknown task {name!r}: no module {module_name!r} ({e})") from e
    if not hasattr(module, "make_task"):
        raise ValueError(f"task module {module_name!r} has no make_task(**params) function")
    return module.make_task(**check_params(module.make_task, params or {}))


def check_params(make_task: Callable[..., Task], params: dict[str, Any]) -> dict[str, Any]:
    """`params` validated against `make_task`'s parameters and their type hints (pydantic, strict:
    a YAML `2` fits `int`, `"2"` and `true` do not; an int fits `float`; a string fits a `Path`).
    Returns the validated values; raises TaskParamsError listing every problem."""
    from pydantic import TypeAdapter, ValidationError

    sig = inspect.signature(make_task)
    try:
        hints = typing.get_type_hints(make_task)
    except Exception:  # noqa: BLE001 - an unresolvable annotation: check names, not types
        hints = {}
    named = {n: p for n, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    problems, out = [], {}
    for key, value in params.items():
        if key not in named:
            if not takes_any:
                problems.append(f"task.params.{key}: unknown parameter (make_task takes {', '.join(named) or 'none'})")
            out[key] = value
            continue
        try:
            adapter = TypeAdapter(hints[key])
        except Exception:  # noqa: BLE001 - no hint, or one pydantic cannot check (a Callable): passed as it is
            out[key] = value
            continue
        hint = hints[key]
        try:
            out[key] = adapter.validate_python(value, strict=True)
        except ValidationError:
            try:  # a path from YAML is a string: the one lax conversion allowed
                if not (isinstance(value, str) and _mentions_path(hint)):
                    raise
                out[key] = adapter.validate_python(value)
            except ValidationError:
                problems.append(f"task.params.{key}: expected {_type_name(hint)}, got {value!r}")
    for key, p in named.items():
        if p.default is p.empty and key not in params:
            problems.append(f"task.params.{key}: required (make_task has no default for it)")
    if problems:
        raise TaskParamsError(problems)
    return out


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _mentions_path(hint: Any) -> bool:
    if isinstance(hint, type):
        return issubclass(hint, PurePath)
    return any(_mentions_path(a) for a in typing.get_args(hint))


def write_chat_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> int:
    """Write SFT rows ({"messages": [...], "tools": [...]}) as JSONL; returns how many. The file
    appears whole or not at all (written under a temporary name, then renamed)."""
    n = 0
    with atomic_file(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n
