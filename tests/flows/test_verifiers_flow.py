"""Environments written for verifiers (the real package) train a GRPO step through the pipeline `rlops run` uses:
the shipped SingleTurnEnv config through the Prefect flow, a ToolEnv with two tools (a model that has memorised
a tool call, so its episodes really call a tool) and a custom MultiTurnEnv game whose rubric reads the game's
state and ranks the group; the ToolEnv on vLLM's CPU wheel too."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from flows import pipeline
from flows.run_config import from_dict, load_run_config
from stages.common import StageContext
from storage.schema import Rollout, from_table
from storage.workspace import Workspace
from tests.built_once import built_once
from tests.scripted_model import train_scripted

ENVS = str(Path(__file__).resolve().parents[1] / "tasks" / "verifiers_envs_for_tests.py")


def _config(model_dir: Path, name: str, env_args: dict[str, Any], **rollout: Any) -> dict[str, Any]:
    return {"name": name, "base_model": str(model_dir), "steps": 1,
            "task": {"name": "verifiers", "params": {"env": ENVS, "env_args": env_args, "episode_timeout": 60}},
            "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 24, "max_total_tokens": 768,
                        **rollout},
            "score": {"rewards": [{"fn": "rewards.verifiers.functions"}]},
            "grpo": {"step_without_signal": True}, "eval": {"n_prompts": 1, "every": 1}}


def _rewards(ws: Workspace) -> dict[str, list[Any]]:
    rows = ws.query("SELECT w.reward_name AS name, w.value, w.error FROM rewards w JOIN rollouts r USING (rollout_id) "
                    "WHERE r.split = 'train' ORDER BY w.reward_name, r.rollout_id").to_pylist()
    out: dict[str, list[Any]] = {}
    for r in rows:
        assert r["error"] is None, r
        out.setdefault(r["name"], []).append(r["value"])
    return out


def test_the_shipped_single_turn_env_trains_a_step_through_the_flow(prefect_harness, tmp_path, tiny_model_dir):
    from flows.prefect_flows import train_flow

    cfg = load_run_config("configs/verifiers.yaml", [
        f"base_model={tiny_model_dir}", "name=vf-single", "steps=1", "task.params.env_args={n_train: 4, n_eval: 2}",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "eval.n_prompts=2"])
    # the rubric's functions became the rewards, weighted as the rubric weights them
    assert [(s.name, s.weight) for s in cfg.score.rewards] == [("correct_answer", 1.0), ("number_only", 0.0),
                                                               ("num_turns", 0.0)]
    summary = train_flow(cfg.model_dump(mode="json"), str(tmp_path / "ws"))
    ws = Workspace.open(tmp_path / "ws")
    assert len(summary["policies"]) == 1 and ws.catalog.get_run("vf-single")["status"] == "complete"
    values = _rewards(ws)
    assert sorted(values) == ["correct_answer", "num_turns", "number_only", "total"]
    assert values["num_turns"] == [1.0] * 4 and set(values["correct_answer"]) <= {0.0, 1.0}
    assert values["total"] == values["correct_answer"]  # a metric (weight 0) is stored, not trained on
    rows = ws.query("SELECT prompt_id, messages FROM rollouts WHERE split = 'test'").to_pylist()
    assert {r["prompt_id"] for r in rows} <= {"vf-test-0", "vf-test-1"} and len(rows) >= 2  # base and step-1 evals


@pytest.fixture(scope="module")
def tool_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model taught the ToolEnv's conversation, its two tools in the system prompt as the service renders
    what verifiers sends: greedy, it calls `search`, reads the result and answers."""
    import json

    from tasks.base import render_system_prompt
    from verifiers.clients.openai_chat_completions_client import OpenAIChatCompletionsClient
    from storage.verifiers_env import load_env
    from tests.tasks import verifiers_envs_for_tests as envs

    env = load_env(ENVS, {"kind": "tools"})
    native = OpenAIChatCompletionsClient(object())
    tools = [dict(asyncio.run(native.to_native_tool(t))) for t in env.tool_defs]
    tools = [{**t, "function": dict(t["function"])} for t in tools]
    call = {"name": "search", "arguments": {"query": "Vexhollow"}}
    messages = [{"role": "system", "content": render_system_prompt(envs.SYSTEM, tools)},
                {"role": "user", "content": envs.QUESTION},
                {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
                {"role": "tool", "content": envs.TOOL_RESULT, "tool_call_id": "call_0"},
                {"role": "assistant", "content": "1987"}]
    return built_once(tmp_path_factory, "vf-tools", lambda out: train_scripted(tiny_model_dir, out, messages=messages))


def test_a_tool_env_with_two_tools_calls_them_and_trains_a_step(tmp_path, tool_model_dir):
    ws = Workspace.open(tmp_path / "ws")
    cfg = from_dict(_config(tool_model_dir, "vf-tools", {"kind": "tools"}, temperature=0.0))
    result = pipeline.train(cfg, StageContext(ws, run_name="vf-tools"))
    assert len(result.policies) == 1
    rows = from_table(ws.read_artifact(result.batches[0]), Rollout)
    for r in rows:
        assert r.finish_reason != "error", r.metadata.get("error")
        # the call went to the environment's tool, whose result is a tool turn, not trained on
        assert [m.role for m in r.messages] == ["system", "user", "assistant", "tool", "assistant"]
        assert r.messages[3].content == "d12: Vexhollow Dynamics was founded in 1987." and r.num_tool_calls == 1
        assert r.metadata["vf_turns"] == 2 and r.metadata["vf_stop"] == "no_tools_called"
        trained = [t for t, m in zip(r.token_ids, r.loss_mask) if m]
        assert 0 < len(trained) < len(r.token_ids)
    values = _rewards(ws)
    assert values["answered"] == [1.0] * 4 and values["search_calls"] == [1.0] * 4 and values["add_calls"] == [0.0] * 4
    assert values["total_tool_calls"] == [1.0] * 4


def test_a_multi_turn_game_trains_a_step_its_rubric_reading_state_and_ranking_the_group(tmp_path, tiny_model_dir):
    ws = Workspace.open(tmp_path / "ws")
    data = _config(tiny_model_dir, "vf-guess", {"kind": "guess", "max_turns": 3}, max_new_tokens=4)
    # each function a reward, and the whole rubric as one (weight 0 here: it is the same sum)
    data["score"]["rewards"].append({"name": "rubric", "fn": "rewards.verifiers.rubric", "weight": 0.0})
    cfg = from_dict(data)
    assert [(s.name, s.fn.rsplit(".", 1)[-1], s.weight) for s in cfg.score.rewards] == [
        ("solved", "function", 1.0), ("fewest_guesses", "group_function", 0.5), ("num_turns", "function", 0.0),
        ("rubric", "rubric", 0.0)]
    result = pipeline.train(cfg, StageContext(ws, run_name="vf-guess"))
    assert len(result.policies) == 1
    rows = from_table(ws.read_artifact(result.batches[0]), Rollout)
    for r in rows:
        assert r.finish_reason != "error", r.metadata.get("error")
        state = r.metadata["vf_state"]
        # env_response answers every guess but the last of a game that ran out of turns
        turns_taken = r.metadata["vf_turns"]
        assert state["secret"] in (3, 7) and len(state["guesses"]) == turns_taken - (not state["solved"])
        turns = [m.role for m in r.messages[2:]]
        # the game's answers are user turns between the model's guesses; a won game ends on "Correct!"
        assert turns[0] == "assistant" and turns.count("assistant") == r.metadata["vf_turns"] <= 3
        assert all(turns[i] == "user" for i in range(1, len(turns), 2))
    values = _rewards(ws)
    solved = {r.rollout_id: float(r.metadata["vf_state"]["solved"]) for r in rows}
    assert sorted(values["solved"]) == sorted(solved.values())
    groups: dict[str, list[int]] = {}
    for r in rows:
        groups.setdefault(r.group_id, []).append(len(r.metadata["vf_state"]["guesses"]))
    expected = sorted(1.0 if u == min(g) else 0.0 for g in groups.values() for u in g)
    assert sorted(values["fewest_guesses"]) == expected and 1.0 in expected
    # the rubric as one reward is verifiers' weighted sum of its functions, each one's value in the details
    assert values["rubric"] == [a + 0.5 * b for a, b in zip(values["solved"], values["fewest_guesses"])]
    assert values["total"] == values["rubric"]


@pytest.mark.xdist_group("vllm")
@pytest.mark.slow
def test_the_tool_env_trains_a_step_on_vllm(tmp_path, vllm_backend, vllm_model_dir):
    ws = Workspace.open(tmp_path / "ws")
    cfg = from_dict(_config(vllm_model_dir, "vf-vllm", {"kind": "tools"}, backend="vllm", max_new_tokens=8))
    result = pipeline.train(cfg, StageContext(ws, run_name="vf-vllm"))
    rows = from_table(ws.read_artifact(result.batches[0]), Rollout)
    assert len(result.policies) == 1 and len(rows) == 4
    assert all(r.finish_reason != "error" and sum(r.loss_mask) > 0 for r in rows), [r.metadata.get("error") for r in rows]
    assert all(r.sampling.get("backend", "vllm") == "vllm" for r in rows)
    assert set(_rewards(ws)) >= {"answered", "search_calls", "add_calls", "total_tool_calls", "total"}
