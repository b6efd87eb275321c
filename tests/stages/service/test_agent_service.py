"""Agents in another process (tasks/agent.py `url`): the rollout stage POSTs each episode to a real HTTP
agent service, which calls the policy service with the episode header; what it sends back (or fails
with) becomes the rollout rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from stages import rollout
from stages.common import StageContext, base_policy, identity
from storage.schema import Rollout, from_table
from storage.workspace import Workspace
from tasks.base import load_task
from tests.processes import free_port, start_server, stop
from tests.scripted_model import ANSWER, TOOL_RESULT, scripted_model_dir  # noqa: F401

SERVICE = Path(__file__).with_name("agent_service_for_tests.py")


def start_service(argv: list[str], port: int, cwd: Path | None = None) -> subprocess.Popen:
    """An agent service process (`argv` + `--port PORT`), waited for until GET /version answers; the
    caller stops it (tests.processes.stop)."""
    return start_server(argv + ["--port", str(port)], f"http://127.0.0.1:{port}/version", timeout=60, cwd=cwd)


@pytest.fixture(scope="module")
def service_url() -> Iterator[str]:
    port = free_port()
    proc = start_service([sys.executable, str(SERVICE)], port)
    yield f"http://127.0.0.1:{port}"
    stop(proc)


def _prompts(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t, "metadata": {"answer": ANSWER}}) + "\n"
                            for i, t in enumerate(texts)))
    return path


def _run(tmp_path: Path, model_dir: Path, url: str, texts: list[str], config: dict | None = None,
         **params) -> list[Rollout]:
    ws = Workspace.open(tmp_path / "ws")
    task = rollout.TaskSpec(name="agent", params={"url": f"{url}/rollout", "prompts": str(_prompts(tmp_path / "p.jsonl", texts)),
                                                  **params})
    cfg = rollout.RolloutConfig(**{"prompts_per_step": len(texts), "group_size": 2, "max_new_tokens": 40,
                                   "max_total_tokens": 1024, **(config or {})})
    ref = rollout.run(cfg, StageContext(ws), base_policy(ws, str(model_dir)), task)
    return sorted(from_table(ws.read_artifact(ref.id), Rollout), key=lambda r: r.rollout_id)


@pytest.mark.slow
def test_a_service_agent_is_recorded_token_for_token_behind_an_advertised_url(tmp_path, scripted_model_dir, service_url):
    # Machines apart, on one machine: listen on every interface, tell the agents a given address.
    port = free_port()
    advertised = f"http://127.0.0.1:{port}"
    rows = _run(tmp_path, scripted_model_dir, service_url, ["a"],
                {"serve_host": "0.0.0.0", "serve_port": port, "advertise_url": advertised})
    assert len(rows) == 2
    for r in rows:
        assert r.finish_reason == "answer" and r.segment_starts == [] and r.num_turns == 2
        assert [m.role for m in r.messages] == ["system", "user", "assistant", "tool", "assistant"]
        assert r.messages[2].tool_calls[0].name == "search" and r.messages[3].content == TOOL_RESULT
        assert r.messages[-1].content == ANSWER
        assert r.metadata["base_url"] == f"{advertised}/v1"
        assert sum(r.loss_mask) == r.metadata["completion_tokens"] > 0  # every sampled token, nothing else
        assert len(r.token_ids) == len(r.loss_mask) == len(r.behavior_logprobs)


def test_service_failures_are_error_rows_with_their_reason(tmp_path, tiny_model_dir, service_url):
    rows = _run(tmp_path, tiny_model_dir, service_url, ["fail", "garbage", "list", "slow"],
                {"max_new_tokens": 4}, max_error_frac=1.0, episode_timeout=3.0)
    errors = {r.prompt_id: r.metadata["error"] for r in rows}
    assert all(r.finish_reason == "error" and r.token_ids == [] for r in rows) and len(rows) == 8
    assert errors["p0"].startswith("the agent service answered HTTP 500:") and "own bug" in errors["p0"]
    assert errors["p1"].startswith("malformed reply (not JSON)")
    assert errors["p2"].startswith("malformed reply: expected an object")
    assert errors["p3"] == "TimeoutError: the agent service ran over 3 s"


def test_service_episodes_with_no_recorded_call_say_why(tmp_path, tiny_model_dir, service_url):
    rows = _run(tmp_path, tiny_model_dir, service_url, ["noheader", "wrongmodel"], {"max_new_tokens": 4},
                max_error_frac=1.0)
    assert len(rows) == 4 and all(r.finish_reason == "error" and r.token_ids == [] for r in rows)
    for r in rows:
        assert r.metadata["error"].startswith("the agent made no call recorded under this episode; during this shard "
                                              "2 request(s) came without an episode id")
        assert "2 request(s) named an unknown model 'gpt-4o'" in r.metadata["error"]


def test_past_max_error_frac_the_stage_fails(tmp_path, tiny_model_dir, service_url):
    with pytest.raises(RuntimeError, match="2 of 2 agent episodes failed"):
        _run(tmp_path, tiny_model_dir, service_url, ["fail"], {"max_new_tokens": 4})


def test_the_service_version_identifies_the_agent(tmp_path, service_url):
    prompts = str(_prompts(tmp_path / "p.jsonl", ["a"]))
    asked = load_task("agent", {"url": f"{service_url}/rollout", "prompts": prompts}).agent
    again = load_task("agent", {"url": f"{service_url}/rollout", "prompts": prompts}).agent
    bumped = load_task("agent", {"url": f"{service_url}/rollout", "prompts": prompts, "version": "2"}).agent
    assert asked.url == f"{service_url}/rollout" and asked.fn is None
    assert asked.version == again.version != bumped.version
    with pytest.raises(ValueError, match="cannot reach the agent service"):
        load_task("agent", {"url": f"http://127.0.0.1:{free_port()}/rollout", "prompts": prompts})
    with pytest.raises(ValueError, match="either 'entry'"):
        load_task("agent", {"prompts": prompts})


def test_serve_settings_are_operational_and_checked():
    assert identity(rollout.RolloutConfig(serve_port=8400, advertise_url="http://10.0.0.5:8400")) == \
        identity(rollout.RolloutConfig())
    with pytest.raises(ValueError, match="advertise_url"):
        rollout.RolloutConfig(serve_host="0.0.0.0")
