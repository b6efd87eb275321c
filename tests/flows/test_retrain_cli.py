"""`rlops retrain` as a subprocess: its errors on unknown inputs, before anything starts. (A retrain end to end,
its lineage branch in the catalog and MLflow, and its rerun: tests/flows/views/test_retrain_run.py, on the
views' shared run.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stages.common import base_policy
from storage.workspace import Workspace
from tests.flows.conftest import tiny_config


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}


def _retrain(cfg_path: Path, ws_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flows.cli", "retrain", str(cfg_path), "--workspace", str(ws_dir), *extra],
                          env=_env(), capture_output=True, text=True, timeout=900)


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
