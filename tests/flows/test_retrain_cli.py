"""`rlops retrain` end to end, as a subprocess: the CLI, its Prefect flow (on the temporary server
it starts), the new lineage branch in the catalog and MLflow, and its errors on unknown inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from flows import pipeline
from flows.run_config import from_dict
from stages.common import StageContext, base_policy
from storage.workspace import Workspace
from tests.flows.conftest import tiny_config


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}


def _retrain(cfg_path: Path, ws_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flows.cli", "retrain", str(cfg_path), "--workspace", str(ws_dir), *extra],
                          env=_env(), capture_output=True, text=True, timeout=900)


def _count(ws: Workspace, sql: str) -> int:
    return ws.query(sql).to_pylist()[0]["n"]


@pytest.fixture
def trained_run(tmp_path: Path, tiny_model_dir: Path) -> tuple[Workspace, pipeline.TrainResult, dict]:
    """A two-step run 'r' (no SFT) trained directly, and its config dict."""
    cfg = tiny_config(tiny_model_dir, name="r")
    cfg["sft"] = None
    ws = Workspace.open(tmp_path / "ws")
    return ws, pipeline.train(from_dict(cfg), StageContext(ws, run_name="r")), cfg


@pytest.mark.slow
def test_cli_retrain_replays_a_run_on_the_edited_reward(tmp_path, trained_run):
    ws, result, cfg = trained_run
    cfg["score"]["rewards"][1]["params"] = {"limit": 16}  # an edited reward
    cfg_path = tmp_path / "edited.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    rollouts = _count(ws, "SELECT count(*) AS n FROM rollouts")
    total = pipeline.score.versions(from_dict(cfg).score)["total"]

    out = _retrain(cfg_path, ws.root, "--run", "r", "--from", result.base)
    assert out.returncode == 0, out.stderr[-3000:]

    lineage = ws.catalog.checkpoints("r-retrain")
    assert [c["step"] for c in lineage] == [1, 2] and out.stdout.strip().splitlines()[-1] == lineage[-1]["policy_id"]
    assert lineage[0]["parent_id"] == result.base and lineage[1]["parent_id"] == lineage[0]["policy_id"]
    assert {c["trained_on"]["reward"] for c in lineage} == {f"total@{total}"}
    assert [c["trained_on"]["batches"] for c in lineage] == [[b] for b in result.batches]  # the run's own batches
    assert set(c["policy_id"] for c in lineage).isdisjoint(result.policies)
    assert _count(ws, "SELECT count(*) AS n FROM rollouts") == rollouts  # nothing generated

    run = ws.catalog.get_run("r-retrain")
    assert run["status"] == "complete" and run["config"]["retrain_of"] == "r"
    client = MlflowClient(ws.settings.mlflow_uri)
    parent = client.get_run(run["mlflow_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["rlops.replayed_run"] == "r"
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{run['mlflow_run_id']}'")
    assert {c.data.tags["rlops.artifact_id"] for c in children if c.data.tags["rlops.stage"] == "grpo"} == \
        {c["policy_id"] for c in lineage}
    assert {c.info.status for c in children} == {"FINISHED"}

    # again, with --json: every stage is found in the catalog, the same lineage comes back
    again = _retrain(cfg_path, ws.root, "--run", "r", "--from", result.base, "--json")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.strip().splitlines()[-1]) == {"lineage": [c["policy_id"] for c in lineage]}
    assert len(ws.catalog.checkpoints("r-retrain")) == 2


@pytest.mark.parametrize("args, message", [
    (["--run", "r", "--from", "no-such-policy"], "unknown policy 'no-such-policy'"),
    (["--run", "no-such-run", "--from", "BASE"], "run 'no-such-run' has no training rollout batches"),
])
def test_cli_retrain_rejects_unknown_inputs_before_starting_anything(tmp_path, tiny_model_dir, args, message):
    ws = Workspace.open(tmp_path / "ws")
    base = base_policy(ws, str(tiny_model_dir))
    cfg_path = tmp_path / "r.yaml"
    cfg_path.write_text(yaml.safe_dump(tiny_config(tiny_model_dir, name="r")))
    out = _retrain(cfg_path, ws.root, *[base if a == "BASE" else a for a in args])
    assert out.returncode == 1 and message in out.stderr, out.stderr[-3000:]
    assert ws.catalog.runs() == []  # no run recorded, no MLflow parent started
    assert not (ws.root / "prefect").exists()  # no Prefect server was started
