"""The framework examples (examples/frameworks/): each entry loads with a signature rlops accepts, and
the LangGraph, LiteLLM and Anthropic ones run through the rollout stage (their histories converted, their
calls recorded), and the LangGraph and Anthropic (streamed) ones train one GRPO step through the pipeline,
on a tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages import rollout
from stages.common import StageContext, base_policy
from storage.schema import Rollout, from_table
from storage.workspace import Workspace
from tasks.agent import load_entry
from tasks.base import load_task
from tests.stages.service.agents_for_tests import example_pipeline_config

FRAMEWORKS = Path(__file__).resolve().parents[3] / "examples" / "frameworks"
ENTRIES = ["langgraph/agent.py:rollout", "openai_agents/agent.py:rollout", "openai_agents/agent.py:rollout_responses",
           "pydantic_ai/agent.py:rollout", "smolagents/agent.py:rollout", "litellm/agent.py:rollout",
           "anthropic/agent.py:rollout", "anthropic/agent.py:rollout_streamed"]


@pytest.mark.parametrize("entry", ENTRIES)
def test_each_framework_example_is_an_endpoint_entry(tmp_path, entry):
    fn, source = load_entry(f"{FRAMEWORKS / entry}")
    assert "import rlops" not in source.read_text() and "from tasks" not in source.read_text()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "q"}\n')
    assert load_task("agent", {"entry": f"{FRAMEWORKS / entry}", "prompts": str(prompts)}).agent.form == "endpoint"


@pytest.mark.parametrize("name", ["langgraph", "litellm", "anthropic"])
def test_a_framework_example_is_recorded_and_its_history_stored(tmp_path, tiny_model_dir, name):
    ws = Workspace.open(tmp_path / "ws")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "prompt": "In which town was Grougo Ninael born?",
                                   "metadata": {"answer": "Fograndford"}}) + "\n")
    entry = f"{FRAMEWORKS / name / 'agent.py'}:rollout"
    task = rollout.TaskSpec(name="agent", params={"entry": entry, "prompts": str(prompts)})
    config = rollout.RolloutConfig(prompts_per_step=1, group_size=1, max_new_tokens=8, max_total_tokens=1024)
    ref = rollout.run(config, StageContext(ws), base_policy(ws, str(tiny_model_dir)), task)
    (row,) = from_table(ws.read_artifact(ref.id), Rollout)
    assert row.finish_reason == "answer" and "messages_note" not in row.metadata, row.metadata
    # LangGraph's state and the Messages API's history hold no system prompt: the recorded one is put
    # back in front of its messages; LiteLLM's history keeps it (and mixes dicts with LiteLLM's Message objects).
    assert [m.role for m in row.messages] == ["system", "user", "assistant"]
    assert row.messages[0].content.startswith("You answer questions about a private knowledge base")
    assert row.messages[1].content == "In which town was Grougo Ninael born?"
    assert 0 < sum(row.loss_mask) <= 8 and len(row.token_ids) == len(row.loss_mask) == len(row.behavior_logprobs)


@pytest.mark.parametrize("entry", ["langgraph/agent.py:rollout", "anthropic/agent.py:rollout_streamed"])
def test_a_framework_example_trains_one_grpo_step(tmp_path, tiny_model_dir, entry):
    from flows import pipeline
    from flows.run_config import from_dict

    raw = example_pipeline_config(tiny_model_dir, "example-step", eval_every=1)
    raw["task"]["params"]["entry"] = f"{FRAMEWORKS / entry}"
    raw["steps"], raw["eval"]["n_prompts"] = 1, 1
    ws = Workspace.open(tmp_path / "ws")
    result = pipeline.train(from_dict(raw), StageContext(ws, run_name="example-step"), on_step=lambda row: None)
    rows = ws.query("SELECT finish_reason, num_tokens FROM rollouts WHERE batch_id = ?", [result.batches[0]]).to_pylist()
    assert len(rows) == 8 and all(r["num_tokens"] > 0 and r["finish_reason"] != "error" for r in rows)
    lineage = ws.catalog.get_checkpoint(result.final)
    assert lineage["kind"] == "grpo" and lineage["step"] == 1
