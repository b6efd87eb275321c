"""A scheduled run, executed: `rlops schedule` serves its deployment on a real `prefect server`
(127.0.0.1), the test triggers it with `run_deployment` (what the cron schedule does at its hour),
and each run continues the lineage from the latest checkpoint on the prompts added since the last,
then goes through the promotion gate (tests/flows/test_promotion.py has the gate on a model that learns)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from mlflow.tracking import MlflowClient

from flows import pipeline
from flows.run_config import from_dict
from stages.common import StageContext
from storage.workspace import Workspace
from tests.flows.conftest import tiny_config


def _rows(questions: range, offset: int) -> list[dict[str, Any]]:
    return [{"question": f"What is {a} + {offset}?", "answer": a + offset, "split": "train"} for a in questions]


def _append(data: Path, rows: list[dict[str, Any]]) -> None:
    with data.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))


def _wait_for_deployment(url: str, name: str, server: subprocess.Popen) -> None:
    deadline = time.time() + 300
    while True:
        assert server.poll() is None, server.stdout.read()
        assert time.time() < deadline, "the deployment never appeared"
        r = httpx.post(f"{url}/deployments/filter", json={"deployments": {"name": {"any_": [name]}}})
        if r.status_code == 200 and r.json():
            return
        time.sleep(1)


def _trigger(url: str, deployment: str) -> Any:
    """One run of the served deployment, as its schedule would start it; returns the finished flow run."""
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: url}):
        return run_deployment(deployment, timeout=900, poll_interval=1)


def _questions(ws: Workspace, batch_id: str) -> list[str]:
    rows = ws.query("SELECT DISTINCT messages[2].content AS q FROM rollouts WHERE batch_id = "
                    f"'{batch_id}'").to_pylist()  # batch ids are hex digests
    return sorted(r["q"] for r in rows)


def _latest(ws: Workspace, run_name: str) -> dict[str, Any]:
    return [c for c in ws.catalog.checkpoints(run_name) if c["kind"] == "grpo"][-1]


@pytest.mark.slow
def test_triggered_deployment_runs_and_continues_the_lineage_on_new_prompts(prefect_server, tmp_path, tiny_model_dir):
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows(range(10, 14), 1)))
    _append(data, [{"question": "What is 50 + 50?", "answer": 100, "split": "test"}])
    cfg = tiny_config(tiny_model_dir, name="nightly", steps=1)
    cfg.update(sft=None, task={"name": "arithmetic", "params": {"data_file": str(data)}})
    cfg["eval"]["n_prompts"] = 1
    cfg_path = tmp_path / "nightly.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    ws_dir = tmp_path / "ws"

    # an existing lineage: two steps over all four train rows
    ws = Workspace.open(ws_dir)
    first = pipeline.train(from_dict({**cfg, "steps": 2}), StageContext(ws, run_name="nightly"))

    env = {**os.environ, "PREFECT_API_URL": prefect_server, "PREFECT_HOME": str(tmp_path / "client-home"),
           "PREFECT_RUNNER_POLL_FREQUENCY": "1"}  # the served runner looks for due runs every second, not every 10
    served = subprocess.Popen([sys.executable, "-m", "flows.cli", "schedule", str(cfg_path), "--cron", "0 3 * * *",
                               "--workspace", str(ws_dir)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_for_deployment(prefect_server, "nightly", served)

        _append(data, _rows(range(70, 72), 2))  # prompts added since the last run
        run1 = _trigger(prefect_server, "rlops-scheduled-train/nightly")
        assert run1.state.is_completed(), run1.state
        after1 = _latest(ws, "nightly")
        assert after1["parent_id"] == first.final and after1["step"] == 3
        batch1 = after1["trained_on"]["batches"][0]
        assert _questions(ws, batch1) == ["What is 70 + 2?", "What is 71 + 2?"]

        _append(data, _rows(range(80, 82), 3))
        run2 = _trigger(prefect_server, "rlops-scheduled-train/nightly")
        assert run2.state.is_completed(), run2.state
        after2 = _latest(ws, "nightly")
        assert after2["parent_id"] == after1["policy_id"] and after2["step"] == 4  # continues the first trigger
        assert _questions(ws, after2["trained_on"]["batches"][0]) == ["What is 80 + 3?", "What is 81 + 3?"]
    finally:
        os.killpg(served.pid, signal.SIGTERM)
        served.wait(timeout=60)

    # each triggered run was a flow run of the deployment, recorded as a completed run with its MLflow parent
    assert run1.deployment_id == run2.deployment_id and run1.id != run2.id
    run = ws.catalog.get_run("nightly")
    assert run["status"] == "complete"
    client = MlflowClient(ws.settings.mlflow_uri)
    parent = client.get_run(run["mlflow_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["rlops.final_policy"] == after2["policy_id"]

    # each triggered run went through the promotion gate: the first version became the champion; the second,
    # no better on the held-out prompt (the random tiny model answers it wrong either way), stayed challenger
    decisions = [(r["action"], r["promoted"], r["challenger"]) for r in ws.catalog.promotions("nightly")]
    assert decisions == [("first", True, after1["policy_id"]), ("gate", False, after2["policy_id"])]
    assert client.get_model_version_by_alias("nightly", "champion").tags["rlops.policy_id"] == after1["policy_id"]
    assert client.get_model_version_by_alias("nightly", "challenger").tags["rlops.policy_id"] == after2["policy_id"]
