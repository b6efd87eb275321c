"""The external doc_search agent (examples/doc_search_openai) trained through the Prefect flow that
`rlops run` uses: the policy service runs inside a Prefect task's thread."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage.workspace import Workspace

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "doc_search_openai"


@pytest.mark.slow
def test_example_agent_through_the_prefect_flow(prefect_harness, tmp_path, tiny_model_dir):
    from flows.prefect_flows import train_flow

    cfg = {
        "name": "agent-flow", "base_model": str(tiny_model_dir),
        "task": {"name": "agent", "params": {"entry": f"{EXAMPLE / 'agent.py'}:rollout",
                                             "prompts": str(EXAMPLE / "prompts.jsonl")}},
        "steps": 2,
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8, "max_total_tokens": 512},
        "score": {"rewards": [{"name": "correct", "fn": "rewards.builtin.exact_match", "params": {"mode": "contains"}},
                              {"name": "odd", "fn": "tests.stages.agents_for_tests.odd_answer_length"}],
                  "total": None},
        "train_reward": "odd",
        "eval": {"n_prompts": 2, "every": 2, "metric": "correct"},
    }
    summary = train_flow(cfg, str(tmp_path / "ws"))
    ws = Workspace.open(tmp_path / "ws")
    assert len(summary["policies"]) == 2 and ws.catalog.get_run("agent-flow")["status"] == "complete"
    rows = ws.query("SELECT count(*) AS n, min(num_tokens) AS shortest FROM rollouts WHERE task = 'agent' "
                    "AND split = 'train'").to_pylist()[0]
    assert rows["n"] == 16 and rows["shortest"] > 0
    assert ws.catalog.get_checkpoint(summary["final"])["step"] == 2
