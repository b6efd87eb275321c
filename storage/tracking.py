"""MLflow glue: a pipeline run is a parent MLflow run, each stage a child run.

Uses `MlflowClient` with explicit run ids throughout: MLflow's fluent active-run stack is
thread-local, so Prefect task threads and Ray workers could not see the parent otherwise.
Artifact ids are written as tags (`rlops.artifact_id`), and the catalog stores MLflow run
ids, so each side points at the other. mlflow is imported lazily (~2 s).

A write that fails for lack of space (a full disk, a file-size limit) raises `WriteError` naming
the SQLite database or the artifact's destination: MLflow itself reports only "disk I/O error".
SQLite rolls the failed transaction back, and MLflow writes artifacts to a temp name first, so
nothing partial is recorded; the same call succeeds once there is space again.
"""

from __future__ import annotations

import errno
import math
import os
import sqlite3
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import unquote, urlparse

from storage.atomic import WriteError, copy_if_absent, write_error
from storage.settings import no_telemetry

no_telemetry()  # before mlflow is first imported: it reads its switch then

PARENT_TAG = "mlflow.parentRunId"  # what MLflow's UI uses to nest runs
RUN_NAME_TAG = "mlflow.runName"



def metric_key(name: str) -> str:
    """`name` as an MLflow metric key: "@" becomes "_at_" (the evals' "pass@k"), and any other character
    MLflow refuses (it takes letters, digits, "_", "-", ".", " ", ":" and "/") becomes "_"."""
    name = name.replace("@", "_at_")
    return "".join(c if c.isalnum() or c in "_-. :/" else "_" for c in name)


def _new_database(db: Path) -> None:
    """Create the SQLite database `db` as a copy of an empty MLflow database (every table made, every schema
    migration run) kept per MLflow version in rlops' cache. MLflow's own creation runs each migration:
    measured ~0.7 s of CPU per new workspace, a copy ~0.02 s. MLflow opens the copy as it opens any database
    at its current schema. Linked into place, so a database another process made meanwhile is kept."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from storage.settings import cache_dir

    template = cache_dir() / "mlflow" / f"empty-{mlflow.__version__}.db"
    if not template.exists():
        template.parent.mkdir(parents=True, exist_ok=True)
        made = template.with_name(f".{template.name}.{uuid.uuid4().hex[:8]}.tmp")
        MlflowClient(tracking_uri=f"sqlite:///{made}").search_experiments()  # creates and migrates it
        os.replace(made, template)
    db.parent.mkdir(parents=True, exist_ok=True)
    try:
        copy_if_absent(template, db)
    except OSError as e:
        raise write_error(db, e) from e


def _schema_head_once() -> None:
    """Have MLflow find its newest database schema revision once per process. Each new tracking store (one per
    workspace a process opens) checks its database against it, and MLflow finds it by loading every one of its
    migration scripts (67 files): a new workspace's tracker started in ~21 ms, ~9 ms with this
    (bench/bench_start_costs.py). The answer depends only on the installed MLflow, so the first one is kept (where
    MLflow has no such function, nothing changes)."""
    import functools

    from mlflow.store.db import utils

    find = getattr(utils, "_get_latest_schema_revision", None)
    if find is not None and not hasattr(find, "cache_info"):
        utils._get_latest_schema_revision = functools.cache(find)


class Tracker:
    """Creates and logs MLflow runs for one experiment."""

    def __init__(self, tracking_uri: str, artifact_location: str, experiment: str = "rlops"):
        from mlflow.tracking import MlflowClient

        _schema_head_once()
        self.tracking_uri = tracking_uri
        # The database file a failed write names (None for a remote tracking server).
        self.db_path = tracking_uri.removeprefix("sqlite:///") if tracking_uri.startswith("sqlite:///") else None
        with self._writing():
            if self.db_path and not Path(self.db_path).exists():
                _new_database(Path(self.db_path))
            self.client = MlflowClient(tracking_uri=tracking_uri)
            found = self.client.get_experiment_by_name(experiment)
            if found is None:
                location = artifact_location if "://" in artifact_location else Path(artifact_location).resolve().as_uri()
                self.experiment_id = self.client.create_experiment(experiment, artifact_location=location)
            else:
                self.experiment_id = found.experiment_id

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """Turn MLflow's "(sqlite3.OperationalError) disk I/O error" into a WriteError naming the database."""
        from mlflow.exceptions import MlflowException
        from sqlalchemy.exc import OperationalError

        try:
            yield
        except (MlflowException, OperationalError) as e:
            reason = _sqlite_storage_error(e)
            if reason is None or self.db_path is None:
                raise
            raise WriteError(errno.EIO, f"cannot write {self.db_path}: {reason} (is the disk full, or a "
                                        "file-size limit reached?)") from e

    def start_run(self, name: str, parent_run_id: str | None = None, tags: dict[str, str] | None = None,
                  params: dict[str, Any] | None = None) -> str:
        """Create a run (a child of `parent_run_id` if given); return its id."""
        all_tags = {RUN_NAME_TAG: name, **(tags or {})}
        if parent_run_id:
            all_tags[PARENT_TAG] = parent_run_id
        with self._writing():
            run = self.client.create_run(self.experiment_id, tags=all_tags, run_name=name)
        if params:
            self.log_params(run.info.run_id, params)
        return run.info.run_id

    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        flat = _flatten(params)
        # MLflow caps param values at 6000 chars; configs are far below that.
        with self._writing():
            self.client.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in flat.items()])

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int | None = None,
                    timestamp_ms: int | None = None) -> None:
        """Log finite numeric metrics (NaN/inf are skipped rather than poisoning charts), under names MLflow
        accepts (`metric_key`: "pass@4" is logged as "pass_at_4").

        A fixed `timestamp_ms` (e.g. when the logged thing was made) makes logging idempotent: MLflow
        keeps one row per (key, timestamp, step, value), so a resumed run re-logging a step adds nothing.
        """
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        batch = [Metric(metric_key(k), float(v), ts, step or 0) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and math.isfinite(float(v))]
        if batch:
            with self._writing():
                self.client.log_batch(run_id, metrics=batch)

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        with self._writing():
            self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        with self._writing():
            self.client.set_terminated(run_id, status=status)

    def running_children(self, parent_run_id: str) -> list[Any]:
        """The child runs (`mlflow.entities.Run`) of `parent_run_id` still marked RUNNING."""
        if not parent_run_id.isalnum():  # MLflow's filter language has no parameters: only ids go in
            raise ValueError(f"not an MLflow run id: {parent_run_id!r}")
        return list(self.client.search_runs(
            [self.experiment_id], max_results=1000,
            filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}' AND attributes.status = 'RUNNING'"))

    @contextmanager
    def stage_run(self, stage: str, parent_run_id: str | None, artifact_id: str, tags: dict[str, str] | None = None,
                  params: dict[str, Any] | None = None) -> Iterator[str]:
        """A child run for one stage execution, tagged with the stage and artifact id; FAILED if the
        body raises an error, KILLED if it is interrupted (KeyboardInterrupt, SystemExit)."""
        run_id = self.start_run(stage, parent_run_id, params=params,
                                tags={"rlops.stage": stage, "rlops.artifact_id": artifact_id, **(tags or {})})
        try:
            yield run_id
        except BaseException as e:
            self.end_run(run_id, "FAILED" if isinstance(e, Exception) else "KILLED")
            raise
        self.end_run(run_id)

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        """Copy a local file into the run's artifacts (under `artifact_path`); WriteError names the destination."""
        try:
            self.client.log_artifact(run_id, str(path), artifact_path)
        except OSError as e:
            if isinstance(e, WriteError) or e.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise
            base = urlparse(self.client.get_run(run_id).info.artifact_uri)
            root = unquote(base.path) if base.scheme in ("", "file") else self.client.get_run(run_id).info.artifact_uri
            dest = "/".join(x for x in (root, artifact_path, Path(path).name) if x)
            raise WriteError(e.errno, f"cannot write {dest}: {e.strerror}") from e


def _sqlite_storage_error(e: BaseException) -> str | None:
    """SQLite's own reason when `e` was caused by a failed write to the database file, else None."""
    while e is not None:
        if isinstance(e, sqlite3.OperationalError) and str(e) in ("disk I/O error", "database or disk is full"):
            return f"SQLite: {e}"
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return None


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
