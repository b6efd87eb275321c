"""Resuming a named run after its driver died: one MLflow parent run per run, however often it resumes.

A run (`rlops run`, a scheduled run, `rlops retrain`) owns an MLflow parent run, recorded in the
catalog's `runs` row. When its driver process is killed (SIGKILL, the OOM killer, a lost machine)
nothing closes that parent, nor the child run of the stage that was executing: both stay RUNNING.
Running the same command again resumes the run, and `parent_run` then

- continues the same parent run (its children, metrics and final tags stay in one place);
- closes the children the dead driver left RUNNING as KILLED, tagged with why, and records each
  as a `killed` row in the catalog's `stage_runs` (the stage itself reruns from its inputs, since
  its artifact was never completed);
- refuses, with `RunInProgress`, when the driver that last held the run is still alive on this
  machine: closing a live run's stages would be wrong, and two drivers must not write one run.

Which driver holds a run is the parent run's `rlops.driver` tag: host, pid and process start time
(the start time tells a live driver from an unrelated process that reuses its pid).
"""

from __future__ import annotations

import os
import socket
from datetime import datetime, timezone
from typing import Any

from storage.schema import now
from storage.workspace import Workspace

DRIVER_TAG = "rlops.driver"
INTERRUPTED_TAG = "rlops.interrupted"


class RunInProgress(ValueError):
    """The run is being driven by another live process; resuming it now would corrupt it."""


def parent_run(ws: Workspace, run_name: str, *, title: str, tags: dict[str, str],
               params: dict[str, Any] | None = None) -> str:
    """The MLflow parent run id for `run_name`: the unfinished one, resumed (see the module
    docstring), or a new run named `title` with `tags` and `params`. Marks this process as its driver."""
    existing = ws.catalog.get_run(run_name)
    previous = _run(ws, existing["mlflow_run_id"]) if existing and existing["status"] != "complete" else None
    if previous is not None:
        parent = previous.info.run_id
        holder = previous.data.tags.get(DRIVER_TAG)
        # This process holding it means an earlier call here ended (flows run one at a time).
        if holder and holder != this_driver() and _alive(holder):
            host, pid, _ = holder.rsplit(":", 2)
            raise RunInProgress(f"run {run_name!r} is in progress in process {pid} on {host}: wait for it to "
                                f"finish or stop that process, then run this again to resume")
        close_interrupted(ws, run_name, parent, holder)
    else:
        parent = ws.tracker.start_run(title, tags=tags, params=params)
    ws.tracker.set_tags(parent, {DRIVER_TAG: this_driver()})
    return parent


def close_interrupted(ws: Workspace, run_name: str, parent: str, holder: str | None) -> list[str]:
    """Mark the RUNNING children of `parent` KILLED and record them as killed stage runs; return their ids.
    Call only when their driver (`holder`, as in the DRIVER_TAG) is known to be gone."""
    closed = []
    for child in ws.tracker.running_children(parent):
        run_id, tags = child.info.run_id, child.data.tags
        why = f"its driver ({holder or 'unknown'}) died without closing it; closed when run {run_name!r} resumed"
        ws.tracker.set_tags(run_id, {INTERRUPTED_TAG: why})
        ws.tracker.end_run(run_id, "KILLED")
        inputs = child.data.params.get("inputs", "")
        ws.catalog.record_stage_run({
            "stage": tags.get("rlops.stage"), "artifact_id": tags.get("rlops.artifact_id"),
            "inputs": inputs.split(",") if inputs else [], "status": "killed", "error": why,
            "started_at": datetime.fromtimestamp(child.info.start_time / 1000, tz=timezone.utc),
            "finished_at": now(), "mlflow_run_id": run_id, "run_name": run_name})
        closed.append(run_id)
    return closed


def _run(ws: Workspace, run_id: str | None) -> Any:
    """The MLflow run `run_id`, or None when there is none (e.g. the tracking database was replaced:
    the run then gets a new parent rather than failing on a dangling id)."""
    from mlflow.exceptions import MlflowException

    if not run_id:
        return None
    try:
        return ws.tracker.client.get_run(run_id)
    except MlflowException:
        return None


def this_driver() -> str:
    """`host:pid:start_time` of this process, as stored in DRIVER_TAG."""
    import psutil

    return f"{socket.gethostname()}:{os.getpid()}:{psutil.Process().create_time():.2f}"


def _alive(holder: str) -> bool:
    """Whether the driver named by a DRIVER_TAG value still runs. A driver on another host cannot be
    checked from here and counts as gone (a run is resumed where its workspace is)."""
    import psutil

    host, pid, started = holder.rsplit(":", 2)
    if host != socket.gethostname():
        return False
    try:
        # the same pid and start time: the same process (a reused pid has a later start time)
        return abs(psutil.Process(int(pid)).create_time() - float(started)) < 0.5
    except psutil.NoSuchProcess:
        return False
