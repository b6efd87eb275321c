from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.processes import free_port, start_server, stop


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory: pytest.TempPathFactory):
    """A real (temporary) Prefect server with its own database, for the whole session; the database starts as a
    copy of the migrated empty one, as a new workspace's does (flows/prefect_db.py)."""
    import prefect.testing.utilities as harness

    from flows.prefect_db import copy_template

    folder = tmp_path_factory.mktemp("prefect-harness")
    copy_template(folder / "prefect-test.db")  # the harness names its database so, in the folder mkdtemp gives
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(harness, "mkdtemp", lambda: str(folder))
        with harness.prefect_test_harness(server_startup_timeout=180):  # 2 slow cores
            yield


def rlops_here(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """An `rlops` command's stdout, run by its entry point `flows.cli.main` in this process: for commands that start
    no Prefect flow (a stage without --prefect, a query), which a subprocess would only add ~7 s of CPU importing the
    stack to (docs/BENCHMARKS.md, "Where the suite's CPU goes"). `rlops run` and its kin run as subprocesses."""
    from flows.cli import main

    capsys.readouterr()  # only this command's output
    assert main(list(args)) == 0, capsys.readouterr().err[-3000:]
    return capsys.readouterr().out


def ray_workers(ws: Any, artifact_id: str) -> list[str]:
    """Where the Ray work of the stage that made `artifact_id` ran: its completed stage run's MLflow tag
    `rlops.ray_workers`, one `<node id>:<pid>:<parent pid>` per worker."""
    (run,) = [r for r in ws.catalog.stage_runs(artifact_id) if r["status"] == "complete"]
    return ws.tracker.client.get_run(run["mlflow_run_id"]).data.tags["rlops.ray_workers"].split(",")


def tiny_config(model_dir: Path, name: str = "e2e", steps: int = 2) -> dict[str, Any]:
    """A complete pipeline config (SFT, rollouts, scoring, GRPO, evals) small enough for a tiny model."""
    return {
        "name": name,
        "base_model": str(model_dir),
        "task": {"name": "arithmetic", "params": {"n_train": 20, "n_test": 4}},
        "steps": steps,
        "sft": {"data": "oracle", "max_steps": 2, "batch_size": 2, "eval_fraction": 0.0},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "max_total_tokens": 128},
        "score": {"rewards": [{"name": "correct", "fn": "rewards.builtin.numeric_match"},
                              {"name": "short", "fn": "rewards.builtin.length_penalty", "params": {"limit": 8},
                               "weight": 0.1}]},
        "eval": {"n_prompts": 4, "every": 1, "metric": "correct"},
    }


def expected_rows(cfg: dict[str, Any]) -> dict[str, int]:
    """Row counts of an uninterrupted run of `tiny_config`: training batches plus one eval batch
    per evaluated policy (base, sft, every GRPO step with every=1); a reward row per configured reward
    and one for their weighted total."""
    steps, n, g = cfg["steps"], cfg["rollout"]["prompts_per_step"], cfg["rollout"]["group_size"]
    evaluated = 2 + steps
    rollouts = steps * n * g + evaluated * cfg["eval"]["n_prompts"]
    return {"rollouts": rollouts, "rewards": rollouts * (len(cfg["score"]["rewards"]) + 1), "checkpoints": 2 + steps}


def row_counts(ws: Any) -> dict[str, int]:
    """A workspace's rollout, reward and checkpoint rows (the base counted once), and how many are distinct:
    what `expected_rows` predicts, and what a resumed run must not duplicate."""
    q = ws.query
    return {
        "rollouts": q("SELECT count(*) AS n FROM rollouts").to_pylist()[0]["n"],
        "rewards": q("SELECT count(*) AS n FROM rewards").to_pylist()[0]["n"],
        "checkpoints": q("SELECT count(*) AS n FROM checkpoints WHERE kind != 'base'").to_pylist()[0]["n"] + 1,
        "distinct_rollouts": q("SELECT count(DISTINCT rollout_id) AS n FROM rollouts").to_pylist()[0]["n"],
        "distinct_rewards": q("SELECT count(DISTINCT (rollout_id, reward_name, reward_version)) AS n FROM rewards"
                              ).to_pylist()[0]["n"],
    }


@pytest.fixture
def no_prefect_api(monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    return os.environ


@pytest.fixture
def prefect_server(tmp_path: Path) -> Iterator[str]:
    """A real `prefect server start` on 127.0.0.1 (its own home and database, seeded as `rlops run` seeds a
    workspace's: flows/prefect_db.py); yields its API URL."""
    from flows.prefect_db import seed

    seed(tmp_path / "server-home")
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "server-home"), "PREFECT_UI_ENABLED": "false",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    url = f"http://127.0.0.1:{port}/api"
    proc = start_server([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                        url + "/health", status=200, timeout=240, env=env, every=1.0)
    try:
        yield url
    finally:
        stop(proc, timeout=60)


@pytest.fixture(scope="session")
def async_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> tuple[dict[str, Any], Any, Any]:
    """One in-process asynchronous run, K = 1 and 3 steps (tests/flows/test_async.py `async_config`):
    (its config, its Workspace, its TrainResult). Made once per test process for the tests that read it
    (test_async: the schedule; test_async_ray: a Ray run gives the same ids); they are in xdist group
    "async_run", so one xdist worker runs them all and makes it once."""
    from flows import pipeline
    from flows.run_config import from_dict
    from stages.common import StageContext
    from storage.workspace import Workspace
    from tests.flows.test_async import async_config

    cfg = async_config(tiny_model_dir, "async", k=1, steps=3)
    ws = Workspace.open(tmp_path_factory.mktemp("async-run") / "ws")
    result = pipeline.train(from_dict(cfg), StageContext(ws, run_name=cfg["name"]), on_step=lambda row: None)
    return cfg, ws, result
