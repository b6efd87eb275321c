"""Catalog snapshots read while a run rewrites them (storage.catalog.read_snapshot, and the SQL views built on them)."""

from __future__ import annotations

import threading
import time

import pytest
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from storage.atomic import atomic_file
from storage.catalog import read_snapshot


def _hammer(path, read, seconds: float = 1.5, until_error: bool = False) -> tuple[int, list[str]]:
    """Read `path` with `read` for `seconds` (or until the first error) while a thread replaces it atomically
    with tables of varying size."""
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            n = i % 50 + 1
            with atomic_file(path) as f:
                pq.write_table(pa.table({"kind": ["grpo"] * n, "x": list(range(n))}), f)

    with atomic_file(path) as f:
        pq.write_table(pa.table({"kind": ["sft"], "x": [0]}), f)
    thread = threading.Thread(target=writer)
    thread.start()
    reads, errors = 0, []
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            reads += 1
            try:
                table = read(path)
                assert table.num_rows == len(table["x"]) and set(table["kind"].to_pylist()) <= {"grpo", "sft"}
            except OSError as e:
                errors.append(str(e))
                if until_error:
                    break
    finally:
        stop.set()
        thread.join()
    return reads, errors


def test_a_snapshot_read_during_replacement_is_one_whole_version(tmp_path):
    # pq.read_table(path) opens the file for the footer and again for the pages: a rename in between
    # pairs one version's footer with another's bytes (made certain in the test below); read_snapshot
    # reads through one open, so a real writer racing it never tears it.
    path = tmp_path / "checkpoints.parquet"
    reads, errors = _hammer(path, read_snapshot)
    assert reads > 100 and errors == [], errors[:3]


def test_the_sql_views_read_a_snapshot_being_replaced_whole(tmp_path):
    """`open_views` (every `ws.query`, `rlops sql`, `rlops inspect`) loads the catalog tables from the snapshots.
    DuckDB's read_parquet also reaches a file twice: an asynchronous run's training thread querying while its
    generation thread rewrote a snapshot failed with "TProtocolException: Invalid data" (a suite run, stop 39)."""
    from storage.sql import open_views
    from storage.workspace import Workspace

    settings = Workspace.open(tmp_path / "ws").settings
    path = settings.snapshot_dir / "checkpoints.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)

    def through_views(_):
        views = open_views(settings)
        try:
            return views.con.sql("SELECT kind, x FROM checkpoints").to_arrow_table()
        finally:
            views.con.close()

    reads, errors = _hammer(path, through_views, seconds=3.0)  # each builds every view: ~50 ms alone, more in a suite
    assert reads >= 5 and errors == [], errors[:3]


def _replace(path, n: int) -> None:
    with atomic_file(path) as f:
        pq.write_table(pa.table({"kind": ["grpo"] * n, "x": list(range(n))}), f)


class _ReplacedAfterFirstOpen(pafs.FileSystemHandler):
    """The local filesystem, except that the file is replaced (atomically, by a larger version) right after
    the first open returns: the rename a run makes between a by-path reader's two opens, made certain."""

    def __init__(self, path) -> None:
        self.local, self.path, self.opens = pafs.LocalFileSystem(), path, 0

    def open_input_file(self, p):
        self.opens += 1
        f = self.local.open_input_file(p)
        if self.opens == 1:
            _replace(self.path, 40)
        return f

    def open_input_stream(self, p):
        return self.open_input_file(p)

    def get_file_info(self, paths):
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.local.get_file_info(selector)

    def normalize_path(self, p):
        return p

    def get_type_name(self) -> str:
        return "replaced-after-first-open"

    def __eq__(self, other) -> bool:
        return self is other

    def __ne__(self, other) -> bool:
        return self is not other

    def _unused(self, *args):
        raise NotImplementedError

    create_dir = delete_dir = delete_dir_contents = delete_root_dir_contents = delete_file = _unused
    move = copy_file = open_output_stream = open_append_stream = _unused


def test_a_rename_between_a_by_path_readers_two_opens_tears_it_and_not_read_snapshot(tmp_path, monkeypatch):
    # The race above, made certain instead of waited for (a loaded CI machine once went 30 s without a tear):
    # pq.read_table by path opens the file twice, and a rename in between tears it ...
    path = tmp_path / "checkpoints.parquet"
    _replace(path, 1)
    handler = _ReplacedAfterFirstOpen(path)
    with pytest.raises(OSError):
        pq.read_table(str(path), filesystem=pafs.PyFileSystem(handler))
    assert handler.opens == 2
    # ... while read_snapshot opens once: replaced right after that open, it returns the old version whole.
    import storage.catalog as catalog

    def open_then_replace(p, *args, **kwargs):
        f = open(p, *args, **kwargs)
        _replace(path, 1)
        return f

    monkeypatch.setattr(catalog, "open", open_then_replace, raising=False)
    table = read_snapshot(path)
    assert table.num_rows == 40 and table["x"].to_pylist() == list(range(40))
    assert pq.read_table(path).num_rows == 1  # the replacement happened


def test_duckdb_read_parquet_by_path_tears_on_a_rename_and_the_views_do_not_read_by_path(tmp_path):
    """DuckDB's read_parquet reaches the file by path more than once (its size, then its bytes): a rename in
    between tears it, made certain here through a filesystem that renames right after the first open. The
    views hold what read_snapshot returned, so replacing the file after they open changes nothing in them."""
    import duckdb
    from fsspec.implementations.local import LocalFileSystem

    from storage.sql import open_views
    from storage.workspace import Workspace

    path = tmp_path / "c.parquet"
    _replace(path, 40)

    class ReplacedAfterFirstOpen(LocalFileSystem):
        protocol = "replaced"
        opens = 0

        def _open(self, p, mode="rb", **kwargs):
            f = super()._open(p, mode, **kwargs)
            type(self).opens += 1
            if type(self).opens == 1:
                _replace(path, 1)
            return f

    with duckdb.connect(":memory:") as con:
        con.register_filesystem(ReplacedAfterFirstOpen())
        with pytest.raises(duckdb.Error):
            con.sql(f"SELECT count(*) FROM read_parquet('replaced://{path}')").fetchall()
    assert ReplacedAfterFirstOpen.opens >= 1

    settings = Workspace.open(tmp_path / "ws").settings
    snapshot = settings.snapshot_dir / "checkpoints.parquet"
    snapshot.parent.mkdir(parents=True, exist_ok=True)
    _replace(snapshot, 40)
    views = open_views(settings)
    try:
        _replace(snapshot, 1)
        assert views.con.sql("SELECT count(*) FROM checkpoints").fetchall() == [(40,)]
    finally:
        views.con.close()


KILLED_AFTER_COMMIT = """
import os, sys
from storage.catalog import Catalog
from storage.workspace import Workspace

def die(self, con, table):  # the process ends between the catalog's commit and its snapshot, as a SIGKILL there would
    os._exit(9)

Catalog._snapshot = die
Workspace.open(sys.argv[1]).catalog.upsert_run("killed", {"steps": 1}, None, "running")
"""


def test_a_writer_killed_between_commit_and_snapshot_is_healed_by_the_next_write(tmp_path):
    import subprocess
    import sys

    from storage.workspace import Workspace

    ws = Workspace.open(tmp_path / "ws")
    ws.catalog.upsert_run("before", {"steps": 1}, None, "complete")
    out = subprocess.run([sys.executable, "-c", KILLED_AFTER_COMMIT, str(tmp_path / "ws")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 9, out.stderr[-2000:]
    runs = ws.settings.snapshot_dir / "runs.parquet"
    assert read_snapshot(runs)["run_name"].to_pylist() == ["before"]  # committed, not in the snapshot the views read
    # The next write of any table, by any process (here a stage run, as a resumed run records its cached stages):
    Workspace.open(tmp_path / "ws").catalog.record_stage_run({"stage": "rollout", "artifact_id": "ro-x", "inputs": [],
                                                              "status": "cached", "run_name": "killed"})
    assert sorted(read_snapshot(runs)["run_name"].to_pylist()) == ["before", "killed"]
    assert sorted(r["run_name"] for r in Workspace.open(tmp_path / "ws").query("SELECT run_name FROM runs").to_pylist()) \
        == ["before", "killed"]
    assert not list(ws.settings.snapshot_dir.glob(".*.stale"))
