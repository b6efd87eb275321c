"""No orphans after a crash, with real processes: the temporary Prefect server exits with a driver
that is SIGKILLed alone, and a resumed run closes the MLflow runs its killed driver left RUNNING
and continues the same parent run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import yaml
from mlflow.tracking import MlflowClient

from flows.prefect_flows import SERVER_NICENESS
from flows.resume import DRIVER_TAG, INTERRUPTED_TAG, RunInProgress, parent_run, this_driver
from storage.catalog import read_snapshot
from storage.workspace import Workspace
from tests.flows.conftest import expected_rows, row_counts, tiny_config
from tests.processes import kill, start_run, wait_until

# A driver that starts the temporary server exactly as `rlops run` does (`run_here`), then runs a
# flow that signals it is running and waits for a "go" file.
DRIVER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from prefect import flow
    from flows.prefect_flows import run_here

    @flow
    def wait(ready: str, go: str) -> None:
        Path(ready).touch()
        deadline = time.time() + 600
        while not Path(go).exists() and time.time() < deadline:
            time.sleep(0.2)

    run_here(wait, sys.argv[1], sys.argv[2])
""")


def _driver_env(prefect_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    from flows.prefect_db import seed

    seed(prefect_home)  # as `rlops run` seeds a workspace's home
    return {**env, "PREFECT_HOME": str(prefect_home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "240"}


def _descendants(pid: int, marker: str) -> list[psutil.Process]:
    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for p in procs:
        try:
            if marker in " ".join(p.cmdline()):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def _server_and_watchdog(driver: subprocess.Popen) -> tuple[psutil.Process, psutil.Process]:
    server = wait_until(lambda: _descendants(driver.pid, "prefect.server.api.server:create_app"), driver,
                        "the temporary Prefect server started")
    watchdog = wait_until(lambda: _descendants(driver.pid, "flows.server_watchdog"), driver, "the watchdog started")
    assert len(server) == 1 and len(watchdog) == 1
    return server[0], watchdog[0]


def _clean_up(driver: subprocess.Popen, *others: psutil.Process | None) -> None:
    """Whatever a failed test left: the driver's process group, then the server and watchdog."""
    if driver.poll() is None:
        kill(driver, group=True)
    _reap_leftovers([p for p in others if p is not None])


def _reap_leftovers(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Wait (bounded) for `procs` to exit; kill and return those still alive, so a failing test
    leaves no processes behind either."""
    _, alive = psutil.wait_procs(procs, timeout=60)
    for p in alive:
        p.kill()
    return alive


@pytest.mark.slow
def test_temporary_prefect_server_exits_with_its_driver_killed_while_it_starts(tmp_path):
    """SIGKILL to the driver pid alone (not its group) while its temporary server starts: the server and its
    watchdog exit. (Killed while a flow runs, and after a normal exit: `rlops run` itself, in the resume test.)"""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    driver = subprocess.Popen([sys.executable, str(script), str(tmp_path / "ready"), str(tmp_path / "go")],
                              env=_driver_env(tmp_path / "prefect"), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    server = watchdog = None
    try:
        server, watchdog = _server_and_watchdog(driver)
        # at a lower CPU priority than the training it records (flows.prefect_flows.run_here)
        wait_until(lambda: server.nice() >= SERVER_NICENESS, driver, "the server's priority lowered")
        kill(driver, group=False)  # the driver only, as the OOM killer does
        assert _reap_leftovers([server, watchdog]) == []
    finally:
        _clean_up(driver, server, watchdog)


REPORTER = textwrap.dedent("""
    import json, sys
    import httpx
    from prefect import flow
    from prefect.context import get_run_context
    from prefect.settings import PREFECT_API_URL
    from flows.prefect_flows import run_here

    @flow
    def where() -> tuple[str, str]:
        return PREFECT_API_URL.value(), str(get_run_context().flow_run.id)

    url, run_id = run_here(where)
    state = httpx.get(f"{url}/flow_runs/{run_id}").json()["state"]["type"]
    print(json.dumps({"url": url, "state": state, "server_imported": "prefect.server.api.server" in sys.modules}))
""")


def test_a_flow_reports_to_the_temporary_server_rlops_starts_without_importing_prefects_server(tmp_path):
    """`run_here` with no server configured: the flow runs against the temporary server rlops started (the
    run is recorded there, COMPLETED), and the driver never imports Prefect's server (~2 s of CPU)."""
    script = tmp_path / "reporter.py"
    script.write_text(REPORTER)
    out = subprocess.run([sys.executable, str(script)], env=_driver_env(tmp_path / "prefect"), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["url"].startswith("http://127.0.0.1:") and report["url"].endswith("/api")
    assert report["state"] == "COMPLETED"
    assert report["server_imported"] is False


def _children(client: MlflowClient, parent: str, status: str) -> list:
    experiment = client.get_experiment_by_name("rlops").experiment_id
    return client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{parent}' "
                                                          f"AND attributes.status = '{status}'")


def _running_stage_child(client: MlflowClient, parent: str) -> str | None:
    runs = _children(client, parent, "RUNNING")
    return runs[0].info.run_id if runs else None


# A reward that holds its stage while a gate file exists (and says so): the test kills the driver
# while a stage is certainly RUNNING, not at whatever moment a poll happens to land.
GATED_REWARD = textwrap.dedent("""
    import time
    from pathlib import Path
    from rewards.base import reward

    @reward(low=0.0, high=0.0, unversioned=("gate", "held"))
    def gated(rollout, gate: str, held: str) -> float:
        while Path(gate).exists():
            Path(held).touch()
            time.sleep(0.1)
        return 0.0
""")


@pytest.mark.slow
def test_resume_closes_runs_a_killed_driver_left_running_and_continues_its_parent(tmp_path, tiny_model_dir):
    """`rlops run` SIGKILLed alone while a stage runs (after the first GRPO checkpoint): its Prefect
    server and watchdog go with it (and the rerun's, when it exits normally); rerunning the command
    marks that stage's MLflow run KILLED (and a `killed` stage run in the catalog), continues the same
    parent run, and completes with exactly the rows of an uninterrupted run (none twice), reusing what the
    killed driver finished; its state stays in the workspace. (The harshest kill of a run: its driver
    alone, mid-stage, as the OOM killer does.)"""
    ws_dir, steps = tmp_path / "ws", 2
    gate, held = tmp_path / "gate", tmp_path / "held"
    (tmp_path / "gated.py").write_text(GATED_REWARD)
    cfg = tiny_config(tiny_model_dir, name="crash", steps=steps)
    cfg["score"]["rewards"].append({"name": "gated", "fn": f"{tmp_path / 'gated.py'}:gated", "weight": 0.0,
                                    "params": {"gate": str(gate), "held": str(held)}})
    cfg_path = tmp_path / "crash.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "flows.cli", "run", str(cfg_path), "--workspace", str(ws_dir)]
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    snapshot = ws_dir / "catalog" / "checkpoints.parquet"  # readable while the driver holds the catalog
    runs_snapshot = ws_dir / "catalog" / "runs.parquet"
    client = MlflowClient(tracking_uri=f"sqlite:///{ws_dir / 'mlflow.db'}")

    log = tmp_path / "driver.log"
    driver = start_run(cmd, log, env)
    server = watchdog = None
    try:
        server, watchdog = _server_and_watchdog(driver)
        wait_until(lambda: snapshot.exists() and "grpo" in read_snapshot(snapshot, ["kind"])["kind"].to_pylist(), driver,
                   "the first GRPO checkpoint", timeout=900, every=0.2, log=log)
        gate.touch()  # the next stage that scores holds
        wait_until(held.exists, driver, "a stage held by the gated reward", timeout=900, every=0.2, log=log)
        parent = read_snapshot(runs_snapshot).to_pylist()[0]["mlflow_run_id"]
        held_stages = {r.info.run_id: r.data.tags["rlops.artifact_id"] for r in _children(client, parent, "RUNNING")}
        kill(driver, group=False)  # the driver only, as the OOM killer does
        assert _reap_leftovers([server, watchdog]) == []
    finally:
        _clean_up(driver, server, watchdog)
    assert held_stages  # the kill left RUNNING stage runs (the held stage, and the stage calling it if nested)
    assert {client.get_run(r).info.status for r in held_stages} == {"RUNNING"}
    gate.unlink()

    # The rerun, to its normal exit: its own temporary server and watchdog exit with it.
    rerun = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    server = watchdog = None
    try:
        server, watchdog = _server_and_watchdog(rerun)
        stdout, stderr = rerun.communicate(timeout=900)
        assert rerun.returncode == 0, stderr[-3000:]
        assert _reap_leftovers([server, watchdog]) == []
    finally:
        _clean_up(rerun, server, watchdog)
    out = subprocess.CompletedProcess(cmd, rerun.returncode, stdout, stderr)

    ws = Workspace.open(ws_dir)
    run = ws.catalog.get_run("crash")
    assert run["mlflow_run_id"] == parent and run["status"] == "complete"  # the same parent, continued
    assert client.get_run(parent).info.status == "FINISHED"
    for run_id in held_stages:
        child = client.get_run(run_id)
        assert child.info.status == "KILLED" and "resumed" in child.data.tags[INTERRUPTED_TAG]
        assert child.data.tags["mlflow.parentRunId"] == parent
    killed = ws.query("SELECT * FROM stage_runs WHERE status = 'killed'").to_pylist()
    assert {k["mlflow_run_id"]: k["artifact_id"] for k in killed} == held_stages
    # every stage run of the resumed driver hangs under the same parent; none is left RUNNING
    assert _running_stage_child(client, parent) is None
    assert {r.data.tags["rlops.stage"] for r in _children(client, parent, "FINISHED")} >= {"rollout", "grpo", "evaluate"}
    counts = row_counts(ws)
    expected = expected_rows(cfg)
    assert {k: counts[k] for k in expected} == expected
    assert counts["distinct_rollouts"] == counts["rollouts"] and counts["distinct_rewards"] == counts["rewards"]
    final = out.stdout.strip().splitlines()[-1]
    assert ws.catalog.get_checkpoint(final)["step"] == steps  # the last line is the final policy id
    assert "metric" in out.stdout and "accuracy" in out.stdout  # the base / sft / final table
    assert ws.query("SELECT count(*) AS n FROM stage_runs WHERE status = 'cached'").to_pylist()[0]["n"] > 0
    assert (ws_dir / "prefect").is_dir()  # Prefect's state stayed in the workspace


def test_resume_refuses_while_the_driver_holding_the_run_is_alive(tmp_path):
    """A second driver must not close a live driver's stage runs: resuming a run whose recorded
    driver is a live process fails clearly and changes nothing; once that process is gone it resumes."""
    ws = Workspace.open(tmp_path / "ws")
    parent = parent_run(ws, "busy", title="pipeline:busy", tags={"rlops.run_name": "busy"})
    ws.catalog.upsert_run("busy", {}, parent, "running")
    child = ws.tracker.start_run("rollout", parent, tags={"rlops.stage": "rollout", "rlops.artifact_id": "a1"})
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        holder = psutil.Process(other.pid)
        ws.tracker.set_tags(parent, {DRIVER_TAG: f"{this_driver().rsplit(':', 2)[0]}:{other.pid}:{holder.create_time():.2f}"})
        with pytest.raises(RunInProgress, match=f"in progress in process {other.pid}"):
            parent_run(ws, "busy", title="pipeline:busy", tags={})
        assert ws.tracker.client.get_run(child).info.status == "RUNNING"
    finally:
        other.kill()
        other.wait()
    assert parent_run(ws, "busy", title="pipeline:busy", tags={}) == parent
    assert ws.tracker.client.get_run(child).info.status == "KILLED"
    assert ws.tracker.client.get_run(parent).data.tags[DRIVER_TAG] == this_driver()


def test_resume_in_the_driver_that_holds_the_run_and_after_a_lost_mlflow_run(tmp_path):
    """The process holding a run may resume it (its earlier call has ended); a run whose recorded
    MLflow parent no longer exists (a replaced tracking database) gets a new parent instead of failing."""
    ws = Workspace.open(tmp_path / "ws")
    parent = parent_run(ws, "mine", title="pipeline:mine", tags={})
    ws.catalog.upsert_run("mine", {}, parent, "running")
    assert parent_run(ws, "mine", title="pipeline:mine", tags={}) == parent

    ws.catalog.upsert_run("lost", {}, "0" * 32, "running")
    fresh = parent_run(ws, "lost", title="pipeline:lost", tags={"rlops.run_name": "lost"})
    assert fresh != "0" * 32 and ws.tracker.client.get_run(fresh).data.tags["rlops.run_name"] == "lost"
