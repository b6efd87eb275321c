"""MCP tools (tasks/mcp.py): listed from a real server over stdio and streamable HTTP, called on it,
errors recorded as the agent loop records a built-in tool's."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from stages.policy.agent_loop import call_tools
from storage.schema import ToolCall
from tasks import mcp
from tasks.base import content_digest, load_task
from tests.netguard import die_with_parent
from tests.processes import free_port, start_server, stop
from tests.scripted_model import TOOL_RESULT

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "doc_search_mcp" / "server.py"
TEST_SERVER = REPO / "tests" / "tasks" / "mcp_server_for_tests.py"


def start_http(script: Path, port: int, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`script --http --port PORT` on 127.0.0.1 (with `env` added), waited for until it answers (any
    answer: 406 without an MCP Accept header); the caller stops it (tests.processes.stop)."""
    return start_server([sys.executable, str(script), "--http", "--port", str(port)], f"http://127.0.0.1:{port}/mcp",
                        env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def example_http_url() -> Iterator[str]:
    """The doc_search example served over streamable HTTP on a free 127.0.0.1 port."""
    port = free_port()
    proc = start_http(EXAMPLE, port)
    yield f"http://127.0.0.1:{port}/mcp"
    stop(proc)


def _doc_search_over(server: dict) -> None:
    task = load_task("mcp", {"server": server, "base": "doc_search", "base_params": {"n_train": 2}})
    builtin = load_task("doc_search", {"n_train": 2})
    assert [s["function"]["name"] for s in task.tool_specs] == ["search", "read"]
    for listed, own in zip(task.tool_specs, builtin.tool_specs):
        params, expected = listed["function"]["parameters"], own["function"]["parameters"]
        assert listed["function"]["description"] == own["function"]["description"]
        assert list(params["properties"]) == list(expected["properties"]) and params["required"] == expected["required"]
        assert all(params["properties"][k]["type"] == v["type"] for k, v in expected["properties"].items())
    prompt = builtin.prompts("train")[0]
    assert task.prompts("train") == builtin.prompts("train") and task.max_turns == builtin.max_turns
    assert task.messages(prompt) == builtin.messages(prompt)  # the same system prompt, tool list included
    query, doc_id = prompt.metadata["gold_query"], prompt.metadata["answer_doc_id"]
    assert task.tools["search"](query=query) == builtin.tools["search"](query=query)
    assert task.tools["read"](doc_id=doc_id) == builtin.tools["read"](doc_id=doc_id)


def test_doc_search_tools_listed_and_called_over_stdio(tmp_path):
    server = {"command": ["python", str(EXAMPLE)]}
    _doc_search_over(server)
    # The SFT oracle is doc_search's, tool results included (served by the MCP server).
    from tasks.doc_search import write_oracle_dataset

    assert mcp.write_oracle_dataset(tmp_path / "m.jsonl", n=2, server=server, base="doc_search") == 2
    write_oracle_dataset(tmp_path / "d.jsonl", n=2)
    mine, theirs = ([json.loads(x)["messages"] for x in (tmp_path / f).read_text().splitlines()] for f in ("m.jsonl", "d.jsonl"))
    assert mine == theirs


def test_doc_search_tools_listed_and_called_over_streamable_http(example_http_url):
    _doc_search_over({"url": example_http_url})


def test_tool_errors_and_unknown_tools_become_error_tool_messages(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "q", "prompt": "?"}) + "\n")
    log = tmp_path / "calls.log"
    task = load_task("mcp", {"server": {"command": ["python", str(TEST_SERVER)], "env": {"RLOPS_TEST_MCP_LOG": str(log)}},
                             "prompts": str(prompts)})
    calls = [ToolCall("c0", "broken", json.dumps({"reason": "r1"})), ToolCall("c1", "nope", "{}"),
             ToolCall("c2", "search", json.dumps({"wrong": 1})), ToolCall("c3", "search", json.dumps({"query": "x"}))]
    broken, unknown, bad_args, ok = call_tools(calls, task.tools, timeout=30)
    assert broken.error and broken.content.startswith("error: tool 'broken' raised McpToolError:")
    assert "broken on purpose: r1" in broken.content  # the server's own message
    assert unknown.error and unknown.content == "error: unknown tool 'nope'; available: broken, search"
    assert bad_args.error and "query" in bad_args.content and "Field required" in bad_args.content
    assert not ok.error and ok.content == TOOL_RESULT
    pid, query = log.read_text().split()  # the one valid search ran in the server's process
    assert query == "x" and int(pid) != os.getpid()


def test_a_changed_tool_schema_changes_the_rollout_content_digest(tmp_path):
    # The same task params both times: only the server's answer to list_tools changes.
    prompts, schema = tmp_path / "p.jsonl", tmp_path / "schema"
    prompts.write_text(json.dumps({"id": "q", "prompt": "?"}) + "\n")
    schema.write_text("1")
    params = {"server": {"command": ["python", str(TEST_SERVER)], "env": {"RLOPS_TEST_MCP_SCHEMA_FILE": str(schema)}},
              "prompts": str(prompts)}
    first = load_task("mcp", params)
    again = load_task("mcp", params)
    assert content_digest(first, first.prompts("train")) == content_digest(again, again.prompts("train"))
    schema.write_text("2")
    mcp.close_all()  # as in a new process (the next run): the server starts afresh
    changed = load_task("mcp", params)
    search = next(s for s in changed.tool_specs if s["function"]["name"] == "search")
    assert "k" in search["function"]["parameters"]["properties"]
    # rollout.run puts this digest into the batch id's config: new schema, new rollouts
    assert content_digest(changed, changed.prompts("train")) != content_digest(first, first.prompts("train"))


def test_a_server_that_cannot_start_is_a_config_problem(tmp_path):
    from flows.run_config import from_dict, semantic_problems

    cfg = from_dict({"name": "m", "task": {"name": "mcp", "params": {
        "server": {"command": ["python", "-c", "raise SystemExit(3)"]}, "base": "doc_search"}},
        "score": {"rewards": [{"name": "correct", "fn": "rewards.builtin.exact_match"}]}})
    (problem,) = semantic_problems(cfg)
    assert problem.startswith("task: cannot load 'mcp': ValueError: cannot start or reach the MCP server")
    with pytest.raises(ValueError, match="either 'url'"):
        mcp.check_server({"url": "http://127.0.0.1:1/mcp", "command": ["x"]})


def test_a_stdio_server_dies_with_the_process_that_started_it(tmp_path):
    import psutil

    prompts, log = tmp_path / "p.jsonl", tmp_path / "calls.log"
    prompts.write_text(json.dumps({"id": "q", "prompt": "?"}) + "\n")
    params = {"server": {"command": ["python", str(TEST_SERVER)], "env": {"RLOPS_TEST_MCP_LOG": str(log)}},
              "prompts": str(prompts)}
    script = ("import json, sys, time; from tasks.base import load_task; "
              f"t = load_task('mcp', json.loads({json.dumps(json.dumps(params))})); t.tools['search'](query='q'); "
              "print('ready', flush=True); time.sleep(600)")
    owner = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             env={**os.environ, "PYTHONPATH": str(REPO)}, preexec_fn=die_with_parent)
    try:
        assert owner.stdout.readline().strip() == b"ready"
        server = psutil.Process(int(log.read_text().split()[0]))
        owner.kill()  # no cleanup runs: the server must notice the closed pipe by itself
        owner.wait()
        server.wait(30)  # raises TimeoutExpired if the server outlives its owner
    finally:
        owner.kill()


def test_a_stdio_servers_stderr_goes_to_the_log_not_the_console(tmp_path, capfd, caplog):
    # A server of its own (the env differs from other tests'), so this connection starts it.
    server = mcp.check_server({"command": ["python", str(TEST_SERVER)], "env": {"RLOPS_TEST_MCP_LOG": str(tmp_path / "l")}})
    caplog.set_level(logging.INFO, logger="tasks.mcp")
    conn = mcp.McpConnection(server)
    try:
        assert conn.call("search", {"query": "q"}, timeout=30) == TOOL_RESULT
    finally:
        conn.close()
    logged = [r.getMessage() for r in caplog.records if r.name == "tasks.mcp"]
    assert any(line.endswith("scripted MCP server: serving on stdio") for line in logged), logged
    assert "serving on stdio" not in capfd.readouterr().err  # the server's stderr is not this process's


def test_a_runs_console_shows_no_stdio_server_output_and_its_log_file_has_it(tmp_path):
    # As `rlops run` sets up its console (flows/console.py), in a process of its own: that is global state.
    script = ("import json, sys; from pathlib import Path; from flows.console import quiet_console; from tasks import mcp; "
              "quiet_console(Path(sys.argv[1])); "
              f"c = mcp.connect(mcp.check_server({{'command': ['python', {str(TEST_SERVER)!r}]}})); "
              "print(c.call('search', {'query': 'q'}, timeout=30)[:4]); c.close()")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == TOOL_RESULT[:4] and "serving on stdio" not in out.stdout + out.stderr
    assert "tasks.mcp INFO" in (log := (tmp_path / "logs" / "rlops.log").read_text()) and "serving on stdio" in log
