"""MLflow glue: a pipeline run is a parent MLflow run, each stage a child run.

Uses `MlflowClient` with explicit run ids throughout: MLflow's fluent active-run stack is
thread-local, so Prefect task threads and Ray workers could not see the parent otherwise.
Artifact ids are written as tags (`rlops.artifact_id`), and the catalog stores MLflow run
ids, so each side points at the other. mlflow is imported lazily (~2 s).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

PARENT_TAG = "mlflow.parentRunId"  # what MLflow's UI uses to nest runs
RUN_NAME_TAG = "mlflow.runName"


class Tracker:
    """Creates and logs MLflow runs for one experiment."""

    def __init__(self, tracking_uri: str, artifact_location: str, experiment: str = "rlops"):
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        if found is None:
            location = artifact_location if "://" in artifact_location else Path(artifact_location).resolve().as_uri()
            self.experiment_id = self.client.create_experiment(experiment, artifact_location=location)
        else:
            self.experiment_id = found.experiment_id

    def start_run(self, name: str, parent_run_id: str | None = None, tags: dict[str, str] | None = None,
                  params: dict[str, Any] | None = None) -> str:
        """Create a run (a child of `parent_run_id` if given); return its id."""
        all_tags = {RUN_NAME_TAG: name, **(tags or {})}
        if parent_run_id:
            all_tags[PARENT_TAG] = parent_run_id
        run = self.client.create_run(self.experiment_id, tags=all_tags, run_name=name)
        if params:
            self.log_params(run.info.run_id, params)
        return run.info.run_id

    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        flat = _flatten(params)
        # MLflow caps param values at 6000 chars; configs are far below that.
        self.client.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in flat.items()])

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int | None = None,
                    timestamp_ms: int | None = None) -> None:
        """Log finite numeric metrics (NaN/inf are skipped rather than poisoning charts).

        A fixed `timestamp_ms` (e.g. when the logged thing was made) makes logging idempotent: MLflow
        keeps one row per (key, timestamp, step, value), so a resumed run re-logging a step adds nothing.
        """
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        batch = [Metric(k, float(v), ts, step or 0) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and math.isfinite(float(v))]
        if batch:
            self.client.log_batch(run_id, metrics=batch)

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    @contextmanager
    def stage_run(self, stage: str, parent_run_id: str | None, artifact_id: str,
                  params: dict[str, Any] | None = None) -> Iterator[str]:
        """A child run for one stage execution; FAILED if the body raises."""
        run_id = self.start_run(stage, parent_run_id, tags={"rlops.stage": stage, "rlops.artifact_id": artifact_id},
                                params=params)
        try:
            yield run_id
        except BaseException:
            self.end_run(run_id, "FAILED")
            raise
        self.end_run(run_id)

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
