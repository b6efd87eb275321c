"""The composition root: one place that builds the storage and tracking resources.

    ws = Workspace.open()            # ./rlops-workspace, or RLOPS_WORKSPACE, or an argument
    ws.data.write("rollouts", batch_id, table)
    ws.catalog.complete_artifact(...)
    ws.tracker.start_run(...)        # MLflow, created on first use
    ws.query("SELECT ... FROM rollouts WHERE batch_id = ?", [batch_id])

Local and remote set-ups differ only in `Settings` (a data-root URI, a tracking URI).
"""

from __future__ import annotations

import os
import uuid
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from storage.atomic import write_text_atomic
from storage.catalog import Catalog, Published
from storage.parquet import DataStore, FileInfo
from storage.settings import Settings

if TYPE_CHECKING:
    from storage.sql import ViewCache
    from storage.tracking import Tracker


class Workspace:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.root = settings.workspace
        self.root.mkdir(parents=True, exist_ok=True)
        self.data = DataStore(settings.data_root)
        self.catalog = Catalog(settings.catalog_path, settings.snapshot_dir)

    @classmethod
    def open(cls, workspace: str | Path | None = None) -> "Workspace":
        """Open (creating if needed) the workspace named by the argument, `RLOPS_WORKSPACE` or the default."""
        return cls(Settings.from_env(workspace))

    @cached_property
    def tracker(self) -> "Tracker":
        from storage.tracking import Tracker

        return Tracker(self.settings.mlflow_uri, self.settings.mlflow_artifacts, self.settings.experiment)

    def write_part(self, kind: str, artifact_id: str, table: pa.Table, part: str) -> FileInfo:
        """Write one part file of an artifact atomically, then register it (in that order)."""
        info = self.data.write(kind, artifact_id, table, part=part)
        self.catalog.register_file(artifact_id, kind, info, part)
        return info

    def write_artifacts(self, kind: str, stage: str, items: list[tuple[str, pa.Table, list[str], str, dict]]) -> None:
        """Write several single-file artifacts `(artifact_id, table, inputs, config_hash, meta)`, then
        register and complete them all in one catalog transaction: each is visible whole or not at all."""
        published = [Published(aid, self.data.write(kind, aid, table, part="part-00000"), "part-00000", inputs, chash, meta)
                     for aid, table, inputs, chash, meta in items]
        self.catalog.publish(kind, stage, published)

    def read_artifact(self, artifact_id: str, columns: list[str] | None = None) -> pa.Table:
        """All rows of a (complete or in-progress) artifact's registered files."""
        files = self.catalog.artifact_files(artifact_id)
        if not files:
            raise KeyError(f"no files registered for artifact {artifact_id}")
        return self.data.read([f["path"] for f in files], columns=columns)

    def query(self, sql: str, params: list[Any] | dict[str, Any] | None = None) -> pa.Table:
        """Run SQL over the views (`rollouts`, `rewards`, `evals`) and catalog tables; for stage code.

        Values (names, ids, lists of ids) go in `params` (`?` or `$name` placeholders), never into
        the SQL text, so a quote in a run name is data, not syntax."""
        return self._views.query(sql, params)

    @cached_property
    def _views(self) -> "ViewCache":
        from storage.sql import ViewCache

        return ViewCache(self.settings)

    @cached_property
    def workspace_id(self) -> str:
        """A random id made once per workspace (the file `workspace_id`): what a label names, so a page left open
        on another workspace's review server cannot write into this one (the same run config gives the same
        rollout ids in every workspace). Two processes creating it at once agree: the first link wins."""
        path = self.root / "workspace_id"
        if not path.exists():
            tmp = self.root / f".workspace_id.{uuid.uuid4().hex[:8]}"
            write_text_atomic(tmp, f"ws-{uuid.uuid4().hex[:16]}\n")
            try:
                os.link(tmp, path)  # fails if another process made it first: theirs is kept
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        return path.read_text().strip()

    @property
    def judge_cache_dir(self) -> Path:
        return self.settings.cache_dir / "judge"
