"""An asynchronous run (max_staleness 2) SIGKILLed mid-flight and run again ends with exactly the artifacts
and rows of an uninterrupted run: the same ids, nothing lost, nothing duplicated."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from flows import pipeline
from flows.run_config import from_dict
from stages.common import StageContext
from storage.catalog import read_snapshot
from storage.workspace import Workspace
from tests.flows.test_async import async_config
from tests.processes import kill, start_run, wait_until


def _state(ws: Workspace) -> dict[str, object]:
    q = ws.query
    return {
        "rollout_batches": {a["artifact_id"] for a in ws.catalog.artifacts("rollouts")},
        "checkpoints": {c["policy_id"] for c in ws.catalog.checkpoints()},
        "rollouts": q("SELECT count(*) AS n FROM rollouts").to_pylist()[0]["n"],
        "distinct_rollouts": q("SELECT count(DISTINCT rollout_id) AS n FROM rollouts").to_pylist()[0]["n"],
        "rewards": q("SELECT count(*) AS n FROM rewards").to_pylist()[0]["n"],
        "staleness": sorted(a["meta"]["metrics"]["staleness"] for a in ws.catalog.artifacts("checkpoint")
                            if a["stage"] == "grpo"),
    }


@pytest.mark.slow
def test_async_run_killed_midflight_resumes_to_the_uninterrupted_artifacts(tmp_path, tiny_model_dir, no_prefect_api):
    k, steps = 2, 3
    cfg = async_config(tiny_model_dir, "resume", k, steps)
    reference = Workspace.open(tmp_path / "reference")  # uninterrupted, in-process, no Prefect
    pipeline.train(from_dict(cfg), StageContext(reference, run_name="resume"), on_step=lambda row: None)
    expected = _state(reference)
    assert expected["staleness"] == [0, 1, 2]  # min(s, K) for s = 0..2: the bound reached

    ws_dir = tmp_path / "ws"
    cfg_path = tmp_path / "async.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "flows.cli", "run", str(cfg_path), "--workspace", str(ws_dir)]
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_HOME"}
    log = tmp_path / "killed.log"
    proc = start_run(cmd, log, env)  # killing its group kills its temporary Prefect server
    snapshot = ws_dir / "catalog" / "checkpoints.parquet"  # readable while the flow holds the catalog

    def grpo_checkpoints() -> int:
        return read_snapshot(snapshot, ["kind"])["kind"].to_pylist().count("grpo") if snapshot.exists() else 0

    # step 0 trained; batches 1 and 2 are being (or have been) generated
    wait_until(lambda: grpo_checkpoints() >= 1, proc, "the first GRPO checkpoint (it ended before it could be killed)",
               timeout=900, every=0.2, log=log)
    kill(proc, group=True)
    assert grpo_checkpoints() < steps

    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    got = _state(Workspace.open(ws_dir))
    assert got == expected
    assert got["distinct_rollouts"] == got["rollouts"]
