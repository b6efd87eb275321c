"""`rlops retrain` end to end, as a user runs it after `rlops run`: the CLI, its Prefect flow (on the
temporary server it starts), the new lineage branch in the catalog and MLflow, and the same command
again. Read from the views' shared run (tests/flows/views/conftest.py), which retrains that way; the
errors on unknown inputs are tests/flows/test_retrain_cli.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from flows import pipeline
from flows.run_config import from_dict
from storage.workspace import Workspace
from tests.flows.views.conftest import RETRAINED, RUN

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("views_run")]  # with the other readers of the run


def _count(ws: Workspace, sql: str) -> int:
    return ws.query(sql).to_pylist()[0]["n"]


def test_cli_retrain_replays_the_run_on_the_edited_reward(run_ws: Workspace) -> None:
    ws = run_ws
    retrained: dict[str, Any] = json.loads((ws.root.parent / RETRAINED).read_text())
    total = pipeline.score.versions(from_dict(retrained["config"]).score)["total"]
    run = [c for c in ws.catalog.checkpoints(RUN) if c["kind"] == "grpo"]

    lineage = ws.catalog.checkpoints(f"{RUN}-retrain")
    assert [c["step"] for c in lineage] == [1, 2]
    assert retrained["stdout"].strip().splitlines()[-1] == lineage[-1]["policy_id"]  # the last line: the final policy
    assert lineage[0]["parent_id"] == retrained["from"] and lineage[1]["parent_id"] == lineage[0]["policy_id"]
    assert {c["trained_on"]["reward"] for c in lineage} == {f"total@{total}"}
    assert [c["trained_on"]["batches"] for c in lineage] == [c["trained_on"]["batches"] for c in run]  # the run's own
    assert {c["policy_id"] for c in lineage}.isdisjoint(c["policy_id"] for c in run)
    # nothing generated (the hand-built "tools" batch came after the retrain)
    assert _count(ws, "SELECT count(*) AS n FROM rollouts WHERE batch_id != 'ro-tools'") == retrained["rollouts_before"]

    record = ws.catalog.get_run(f"{RUN}-retrain")
    assert record["status"] == "complete" and record["config"]["retrain_of"] == RUN
    client = MlflowClient(ws.settings.mlflow_uri)
    parent = client.get_run(retrained["mlflow_parent"])  # the first retrain's (the rerun below is another)
    assert parent.info.status == "FINISHED" and parent.data.tags["rlops.replayed_run"] == RUN
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert {c.data.tags["rlops.artifact_id"] for c in children if c.data.tags["rlops.stage"] == "grpo"} == \
        {c["policy_id"] for c in lineage}
    assert {c.info.status for c in children} == {"FINISHED"}

    # again, with --json: every stage is found in the catalog, the same lineage comes back
    assert json.loads(retrained["again"].strip().splitlines()[-1]) == {"lineage": [c["policy_id"] for c in lineage]}
    assert len(ws.catalog.checkpoints(f"{RUN}-retrain")) == 2
