"""`rlops schedule` against a real `prefect server` on 127.0.0.1 (the `prefect_server` fixture), and without one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.flows.conftest import tiny_config

RLOPS = [sys.executable, "-m", "flows.cli"]


def _config(tmp_path: Path, model_dir: Path) -> Path:
    cfg = tmp_path / "nightly.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(model_dir, name="nightly")))
    return cfg


def test_schedule_serves_a_deployment_with_the_cron(prefect_server, tmp_path, tiny_model_dir):
    env = {**os.environ, "PREFECT_API_URL": prefect_server, "PREFECT_HOME": str(tmp_path / "client-home")}
    proc = subprocess.Popen(RLOPS + ["schedule", str(_config(tmp_path, tiny_model_dir)), "--cron", "0 3 * * *",
                                     "--workspace", str(tmp_path / "ws")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 240
        deployment = None
        while deployment is None:
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "the deployment never appeared"
            r = httpx.post(f"{prefect_server}/deployments/filter", json={"deployments": {"name": {"any_": ["nightly"]}}})
            found = r.json() if r.status_code == 200 else []
            deployment = found[0] if found else None
            time.sleep(1)
        crons = [s["schedule"].get("cron") for s in deployment["schedules"]]
        assert crons == ["0 3 * * *"] and all(s["active"] for s in deployment["schedules"])
        assert deployment["parameters"]["config_path"].endswith("nightly.yaml")
        assert deployment["parameters"]["workspace"] == str((tmp_path / "ws").resolve())
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


@pytest.mark.parametrize("api_url", [None, "http://127.0.0.1:9/api"])
def test_schedule_without_a_server_fails_clearly(tmp_path, tiny_model_dir, api_url):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    if api_url:
        env["PREFECT_API_URL"] = api_url
    out = subprocess.run(RLOPS + ["schedule", str(_config(tmp_path, tiny_model_dir)), "--cron", "0 3 * * *"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "needs a running Prefect server" in out.stderr and "prefect server start" in out.stderr


def test_schedule_rejects_a_bad_cron(tmp_path, tiny_model_dir):
    out = subprocess.run(RLOPS + ["schedule", str(_config(tmp_path, tiny_model_dir)), "--cron", "every night"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "invalid cron expression" in out.stderr
