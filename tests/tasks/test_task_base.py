"""The task interface: tool-call parsing, the rendered system prompt, loading tasks by name."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from storage.schema import ToolCall
from tasks.base import Task, load_task, parse_tool_calls, render_system_prompt, write_chat_jsonl

SEARCH = '{"name": "search", "arguments": {"query": "Vobourv Labs"}}'


@pytest.mark.parametrize(
    "text,expected",
    [
        ("The answer is 82.", []),
        (f"<tool_call>{SEARCH}</tool_call>", [ToolCall("call_2_0", "search", '{"query": "Vobourv Labs"}')]),
        (
            f"Let me look. <tool_call>\n{SEARCH}\n</tool_call> and "
            '<tool_call>{"name": "read", "arguments": {"doc_id": "doc-004"}}</tool_call>',
            [
                ToolCall("call_2_0", "search", '{"query": "Vobourv Labs"}'),
                ToolCall("call_2_1", "read", '{"doc_id": "doc-004"}'),
            ],
        ),
        ('<tool_call>{"name": "search"}</tool_call>', [ToolCall("call_2_0", "search", "{}")]),
        # malformed JSON: no name, the text kept as written for the error message
        ('<tool_call>{"name": "search", "arguments": {"query": }</tool_call>',
         [ToolCall("call_2_0", "", '{"name": "search", "arguments": {"query": }')]),
        ("<tool_call>[1, 2]</tool_call>", [ToolCall("call_2_0", "", "[1, 2]")]),
        ("<tool_call></tool_call>", [ToolCall("call_2_0", "", "")]),
        # unclosed tag, cut off mid-JSON (out of tokens): one malformed call
        ('<tool_call>{"name": "search", "argu', [ToolCall("call_2_0", "", '{"name": "search", "argu')]),
        # unclosed tag around complete JSON (generation stopped at the closing tag): read as the call
        (f"<tool_call>{SEARCH}", [ToolCall("call_2_0", "search", '{"query": "Vobourv Labs"}')]),
    ],
)
def test_parse_tool_calls(text: str, expected: list[ToolCall]) -> None:
    assert parse_tool_calls(text, turn=2) == expected


def test_system_prompt_lists_tools_only_when_there_are_some() -> None:
    assert render_system_prompt("Be brief.", []) == "Be brief."
    spec = {"type": "function", "function": {"name": "search", "description": "Find documents.",
                                             "parameters": {"properties": {"query": {"type": "string"}}}}}
    rendered = render_system_prompt("Be brief.", [spec])
    assert rendered.startswith("Be brief.") and "- search(query): Find documents." in rendered
    assert "<tool_call>" in rendered


@pytest.mark.parametrize("name,params,size", [("arithmetic", {"n_train": 7, "n_test": 3}, 7), ("doc_search", {}, 120)])
def test_load_builtin_task(name: str, params: dict[str, object], size: int) -> None:
    task = load_task(name, params)
    assert isinstance(task, Task) and task.name == name
    assert len(task.prompts("train")) == size


def test_load_user_task_by_module_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "mypkg_rlops_test"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mytask.py").write_text(textwrap.dedent('''
        from tasks.base import Prompt, Task

        def make_task(greeting: str = "hi") -> Task:
            prompts = {"train": [Prompt("p0", greeting, {"answer": greeting.upper()})], "test": []}
            return Task(name="mytask", system_prompt="Shout back.", prompts=prompts.__getitem__)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    task = load_task("mypkg_rlops_test.mytask", {"greeting": "hello"})
    assert task.prompts("train")[0].metadata == {"answer": "HELLO"}


@pytest.mark.parametrize("name,message", [("no_such_task", "unknown task"), ("tasks.base", "no make_task")])
def test_load_task_errors(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_task(name)


def test_tool_call_json_round_trip() -> None:
    (call,) = parse_tool_calls(f"<tool_call>{SEARCH}</tool_call>", turn=0)
    assert json.loads(call.arguments) == {"query": "Vobourv Labs"}


def test_write_chat_jsonl_replaces_the_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "new" / "sft.jsonl"
    rows = [{"messages": [{"role": "user", "content": "héllo"}], "tools": []}] * 3
    assert write_chat_jsonl(path, rows) == 3
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows

    def failing() -> Iterator[dict[str, object]]:
        yield rows[0]
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_chat_jsonl(path, failing())
    assert len(path.read_text().splitlines()) == 3  # the old file is untouched
