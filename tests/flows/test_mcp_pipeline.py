"""One GRPO step of the tiny scripted model on an MCP task, through the real pipeline, with the tools
served over stdio and over streamable HTTP: its `search` calls run on the MCP server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows import pipeline
from flows.run_config import from_dict
from stages.common import StageContext
from storage.schema import Rollout, from_table
from storage.workspace import Workspace
from tests.processes import free_port, stop
from tests.scripted_model import ANSWER, QUESTION, SYSTEM, TOOL_RESULT, scripted_model_dir  # noqa: F401
from tests.tasks.test_mcp import TEST_SERVER, start_http


def _config(tmp_path: Path, model_dir: Path, server: dict, name: str) -> dict:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": QUESTION, "split": split,
                                           "metadata": {"answer": ANSWER}}) + "\n"
                               for i, split in enumerate(["train", "train", "test"])))
    return {
        "name": name, "base_model": str(model_dir),
        "task": {"name": "mcp", "params": {"server": server, "prompts": str(prompts), "system_prompt": SYSTEM,
                                           "max_turns": 3}},
        "steps": 1,
        # Sampling at temperature 1 gives the groups different answers (some call search, some not): signal.
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 24, "max_total_tokens": 512,
                    "temperature": 1.0},
        "score": {"rewards": [{"name": "odd", "fn": "tests.stages.service.agents_for_tests.odd_answer_length"},
                              {"name": "correct", "fn": "rewards.builtin.exact_match"}], "total": None},
        "train_reward": "odd",
        "eval": {"n_prompts": 1, "every": 1, "metric": "correct"},
    }


def _train_and_check(tmp_path: Path, model_dir: Path, server: dict, name: str) -> None:
    ws = Workspace.open(tmp_path / "ws")
    result = pipeline.train(from_dict(_config(tmp_path, model_dir, server, name)), StageContext(ws, run_name=name))
    assert len(result.policies) == 1 and ws.catalog.get_checkpoint(result.final)["step"] == 1
    rows = from_table(ws.read_artifact(result.batches[0]), Rollout)
    assert len(rows) == 4 and all(len(r.token_ids) == len(r.loss_mask) and sum(r.loss_mask) > 0 for r in rows)
    # The greedy eval episodes follow the script (sampled training ones rarely do): their search ran on the server.
    evaluated = from_table(ws.query("SELECT * FROM rollouts WHERE split = 'test'"), Rollout)
    tool_messages = [m for r in evaluated for m in r.messages if m.role == "tool"]
    assert len(evaluated) == 2 and len(tool_messages) == 2  # base and step-1 policies, one search each
    assert all(m.name == "search" and m.content == TOOL_RESULT for m in tool_messages)
    assert len((tmp_path / "calls.log").read_text().splitlines()) >= 2  # each one ran on the server
    evals = ws.query("SELECT value FROM evals WHERE metric = 'accuracy' AND policy_id = ?", [result.base]).to_pylist()
    assert evals and evals[0]["value"] == 1.0


@pytest.mark.slow
def test_one_grpo_step_on_mcp_tools_over_stdio(tmp_path, scripted_model_dir):
    server = {"command": ["python", str(TEST_SERVER)], "env": {"RLOPS_TEST_MCP_LOG": str(tmp_path / "calls.log")}}
    _train_and_check(tmp_path, scripted_model_dir, server, "mcp-stdio")


@pytest.mark.slow
def test_one_grpo_step_on_mcp_tools_over_streamable_http(tmp_path, scripted_model_dir):
    port = free_port()
    proc = start_http(TEST_SERVER, port, env={"RLOPS_TEST_MCP_LOG": str(tmp_path / "calls.log")})
    try:
        _train_and_check(tmp_path, scripted_model_dir, {"url": f"http://127.0.0.1:{port}/mcp"}, "mcp-http")
    finally:
        stop(proc)
