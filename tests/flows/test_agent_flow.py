"""The external doc_search agent (examples/doc_search_openai) trained through the Prefect flow that
`rlops run` uses: the policy service runs inside a Prefect task's thread."""

from __future__ import annotations


import pytest

from storage.workspace import Workspace
from tests.stages.service.agents_for_tests import example_pipeline_config


@pytest.mark.slow
def test_example_agent_through_the_prefect_flow(prefect_harness, tmp_path, tiny_model_dir):
    from flows.prefect_flows import train_flow

    cfg = example_pipeline_config(tiny_model_dir, "agent-flow", eval_every=2)
    summary = train_flow(cfg, str(tmp_path / "ws"))
    ws = Workspace.open(tmp_path / "ws")
    assert len(summary["policies"]) == 2 and ws.catalog.get_run("agent-flow")["status"] == "complete"
    rows = ws.query("SELECT count(*) AS n, min(num_tokens) AS shortest FROM rollouts WHERE task = 'agent' "
                    "AND split = 'train'").to_pylist()[0]
    assert rows["n"] == 16 and rows["shortest"] > 0
    assert ws.catalog.get_checkpoint(summary["final"])["step"] == 2
