"""External agent tasks through the rollout stage: the policy served on 127.0.0.1, the user's async
OpenAI agent run G times per prompt, recorded calls stored as rollouts (segments included), agent
errors as error rows, and the example doc_search agent trained by a 2-step pipeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages import rollout
from stages.common import StageContext, base_policy
from storage.schema import Rollout, from_table
from storage.workspace import Workspace
from tasks.base import load_task
from tests.scripted_model import ANSWER, scripted_model_dir  # noqa: F401
from tests.stages.service.agents_for_tests import EXAMPLE, example_pipeline_config

REPO = Path(__file__).resolve().parents[3]


def _prompts(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t, "metadata": {"answer": ANSWER}}) + "\n"
                            for i, t in enumerate(texts)))
    return path


def _run(tmp_path: Path, model_dir: Path, entry: str, texts: list[str], **params) -> tuple[Workspace, list[Rollout]]:
    ws = Workspace.open(tmp_path / "ws")
    policy = base_policy(ws, str(model_dir))
    task = rollout.TaskSpec(name="agent", params={"entry": entry, "prompts": str(_prompts(tmp_path / "p.jsonl", texts)),
                                                  **params})
    config = rollout.RolloutConfig(prompts_per_step=len(texts), group_size=2, max_new_tokens=40, max_total_tokens=1024)
    ref = rollout.run(config, StageContext(ws), policy, task)
    return ws, sorted(from_table(ws.read_artifact(ref.id), Rollout), key=lambda r: r.rollout_id)


@pytest.mark.slow
def test_agent_episodes_become_single_segment_rollouts(tmp_path, scripted_model_dir):
    ws, rows = _run(tmp_path, scripted_model_dir, "tests.stages.service.agents_for_tests:scripted", ["a", "b"])
    assert len(rows) == 4 and {r.group_id for r in rows} == {rows[0].group_id, rows[2].group_id}
    for r in rows:
        assert r.finish_reason == "answer" and r.segment_starts == [] and r.num_turns == 2
        assert [m.role for m in r.messages] == ["system", "user", "assistant", "tool", "assistant"]
        assert r.messages[2].content.startswith("<tool_call>") and r.messages[2].tool_calls[0].name == "search"
        assert r.messages[-1].content == ANSWER and r.num_tool_calls == 1
        assert r.metadata == {"answer": ANSWER, "prompt_seen": r.metadata["prompt_seen"]}
        assert len(r.token_ids) == len(r.loss_mask) == len(r.behavior_logprobs)
        assert sum(r.loss_mask) > 0 and all(lp < 0 for lp, m in zip(r.behavior_logprobs, r.loss_mask) if m)
    # The rollouts score like any others.
    from rewards.builtin import exact_match

    assert [exact_match(r)[0] for r in rows] == [1.0] * 4


@pytest.mark.slow
def test_history_rewriting_agent_is_stored_as_segments(tmp_path, scripted_model_dir):
    _, rows = _run(tmp_path, scripted_model_dir, "tests.stages.service.agents_for_tests:rewriting", ["a"])
    for r in rows:
        ((a0, b0), (a1, b1)) = r.segments()
        assert r.loss_mask[a0] == 0 and r.loss_mask[a1] == 0  # each segment opens with its prompt
        assert r.loss_mask[b0 - 1] == 1 and r.loss_mask[b1 - 1] == 1  # ... and ends with what was sampled
        assert r.messages[1].content.endswith("returned: d12: Vexhollow Dynamics was founded in 1987.")


def test_agent_errors_are_rows_and_too_many_fail_the_stage(tmp_path, tiny_model_dir):
    entry = "tests.stages.service.agents_for_tests:flaky"
    _, rows = _run(tmp_path / "ok", tiny_model_dir, entry, ["fine", "fail here", "fine too", "also fine"],
                   max_error_frac=0.5)
    errors = [r for r in rows if r.finish_reason == "error"]
    assert len(rows) == 8 and len(errors) == 2  # both samples of the failing prompt
    for r in errors:
        assert "RuntimeError: the agent's own bug" in r.metadata["error"] and r.token_ids == [] and r.loss_mask == []
    assert all(sum(r.loss_mask) > 0 for r in rows if r.finish_reason != "error")

    ws = Workspace.open(tmp_path / "bad" / "ws")
    with pytest.raises(RuntimeError, match="2 of 4 agent episodes failed"):
        _run(tmp_path / "bad", tiny_model_dir, entry, ["fail 1", "fine"], max_error_frac=0.25)
    assert ws.query("SELECT count(*) AS n FROM rollouts").to_pylist() == [{"n": 0}]  # nothing half-visible


def test_episodes_with_no_recorded_call_are_error_rows_that_say_why(tmp_path, tiny_model_dir):
    _, rows = _run(tmp_path, tiny_model_dir, "tests.stages.service.agents_for_tests:astray",
                   ["own client", "wrong model"], max_error_frac=1.0)
    assert len(rows) == 4 and all(r.finish_reason == "error" and r.token_ids == [] for r in rows)
    for r in rows:
        error = r.metadata["error"]
        assert error.startswith("the agent made no call recorded under this episode; during this shard ")
        assert "2 request(s) came without an episode id (send the X-Episode-Id header" in error
        assert "2 request(s) named an unknown model 'gpt-4o' (this rollout serves '" in error


@pytest.mark.parametrize("entry", ["endpoint_async", "endpoint_sync"])
def test_endpoint_entries_sync_or_async_are_recorded(tmp_path, tiny_model_dir, entry):
    _, rows = _run(tmp_path, tiny_model_dir, f"tests.stages.service.agents_for_tests:{entry}", ["a", "b"])
    assert len(rows) == 4
    for r in rows:
        assert r.finish_reason in ("answer", "max_turns") and r.messages[0].content in ("a", "b")
        assert sum(r.loss_mask) == r.metadata["completion_tokens"] > 0  # every sampled token, nothing else
        assert len(r.token_ids) == len(r.loss_mask) == len(r.behavior_logprobs)
    assert load_task("agent", {"entry": f"tests.stages.service.agents_for_tests:{entry}",
                               "prompts": str(tmp_path / "p.jsonl")}).agent.form == "endpoint"


@pytest.mark.parametrize("params, message", [
    ({"entry": "no_colon", "prompts": "p.jsonl"}, "must look like"),
    ({"entry": "tests.stages.service.agents_for_tests:missing", "prompts": "p.jsonl"}, "async def missing"),
    ({"entry": "tests.stages.service.agents_for_tests:not_async", "prompts": "p.jsonl"}, "async def not_async"),
    ({"entry": "tests.stages.service.agents_for_tests:two_params", "prompts": "p.jsonl"},
     r"has the signature two_params\(client.*prompt.*; it must be `async def two_params"),
    ({"entry": "tests.stages.service.agents_for_tests:endpoint_three", "prompts": "p.jsonl"},
     r"endpoint_three\(endpoint.*extra.*; it must be"),
    ({"entry": "no.such.module:rollout", "prompts": "p.jsonl"}, "cannot import"),
    ({"entry": "tests.stages.service.agents_for_tests:flaky", "prompts": "missing.jsonl"}, "prompts file not found"),
])
def test_bad_agent_tasks_are_refused_clearly(tmp_path, monkeypatch, params, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "q"}\n')
    with pytest.raises(ValueError, match=message):
        load_task("agent", params)


def test_bad_prompt_lines_name_their_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt": "q"}\n{"id": "a", "prompt": "again"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: duplicate id"):
        load_task("agent", {"entry": "tests.stages.service.agents_for_tests:flaky", "prompts": str(path)})
    path.write_text('{"id": 3, "prompt": "q"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1: each line needs"):
        load_task("agent", {"entry": "tests.stages.service.agents_for_tests:flaky", "prompts": str(path)})


def test_example_tools_match_the_builtin_doc_search_tools():
    """The example agent re-implements search/read without rlops; the work is the same as the built-in task's."""
    from tasks.agent import load_entry
    from tasks.doc_search import DATA, load_jsonl, make_tools

    fn, source = load_entry(f"{EXAMPLE / 'agent.py'}:rollout")
    assert "import rlops" not in source.read_text() and "from stages" not in source.read_text()
    example = __import__(fn.__module__)
    builtin = make_tools(load_jsonl(DATA / "kb_docs.jsonl"))
    for q in load_jsonl(DATA / "kb_questions.jsonl")[:40]:
        assert example.search(q["gold_query"]) == builtin["search"](q["gold_query"])
        assert example.read(q["doc_id"]) == builtin["read"](q["doc_id"])
    assert example.read("nope") == builtin["read"]("nope")


@pytest.mark.slow
def test_example_agent_trains_in_a_two_step_pipeline(tmp_path, tiny_model_dir):
    from flows import pipeline
    from flows.run_config import from_dict

    cfg = from_dict(example_pipeline_config(tiny_model_dir, "agent-e2e", eval_every=1))
    ws = Workspace.open(tmp_path / "ws")
    result = pipeline.train(cfg, StageContext(ws, run_name="agent-e2e"), on_step=lambda row: None)
    assert len(result.policies) == 2 and len(result.batches) == 2
    rows = ws.query("SELECT task, finish_reason, num_tokens, len(segment_starts) AS segments FROM rollouts "
                    f"WHERE batch_id IN ('{result.batches[0]}', '{result.batches[1]}')").to_pylist()
    assert len(rows) == 16 and all(r["task"] == "agent" and r["num_tokens"] > 0 for r in rows)
    lineage = ws.catalog.get_checkpoint(result.final)
    assert lineage["kind"] == "grpo" and lineage["step"] == 2
    trained = [ws.catalog.get_artifact(p)["meta"]["metrics"].get("trained_segments", 0) for p in result.policies]
    assert sum(trained) >= 1  # a random tiny model's answers differ in length parity: groups with signal
    assert set(result.evals) == {result.base, *result.policies}


def test_an_agent_task_refuses_a_sampling_dtype_it_would_not_use(tmp_path, tiny_model_dir):
    """The policy service keeps its own precision: `rollout.dtype` with an agent task is an error before any compute,
    not rows recorded as bf16 that were sampled in fp32."""
    ws = Workspace.open(tmp_path / "ws")
    task = rollout.TaskSpec(name="agent", params={"entry": "tests.stages.service.agents_for_tests:scripted",
                                                  "prompts": str(_prompts(tmp_path / "p.jsonl", ["a"]))})
    config = rollout.RolloutConfig(prompts_per_step=1, group_size=2, max_new_tokens=8, dtype="bfloat16")
    with pytest.raises(ValueError, match="rollout.dtype sets the weights the built-in agent loop samples with"):
        rollout.run(config, StageContext(ws), base_policy(ws, str(tiny_model_dir)), task)
    assert ws.catalog.artifacts("rollouts") == []
