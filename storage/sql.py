"""SQL over the workspace: views over the Parquet tables and read-only copies of the catalog.

`open_views` builds an in-memory DuckDB with
  - views `rollouts`, `rewards`, `evals` over the files of *complete* artifacts, and
  - tables `artifacts`, `files`, `checkpoints`, `stage_runs`, `runs` loaded from the catalog's
    Parquet snapshots (never from catalog.duckdb, which a running pipeline holds for writing), and
  - a view `images` over the workspace's content-addressed image store (storage/images.py), to join
    with `rollouts.image_ids`, and
  - the views over people's labels (`labels`, `label_values`, `label_pairs`, the agreement views:
    storage/label_views.py), built on the registered label files as the other tables are, and
  - the deployment loop's `traffic`, `feedback` and `verdicts` (storage/loop_schema.py) with the view joining them to
    what was trained on them (`traffic_lineage`: storage/loop_views.py), and
  - `judge_drift`: each scoring's judge agreement with the programmatic rewards (storage/drift_views.py).

`Sandbox` is the same, locked down for `rlops sql`: only SELECT/EXPLAIN statements, no file
access outside the data root, no extension loading, locked configuration, a memory limit and
a timeout. It cannot change anything or read anything but the workspace data.

On an object-store data root (`s3://...`) the views scan pyarrow datasets registered on the
connection: pyarrow reads the registered files with the environment's credentials, while DuckDB
itself gets no file or network access at all (no httpfs, no allowed directories), so a query
still reaches only the complete artifacts' files.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import pyarrow as pa

from storage.catalog import DDL, read_snapshot
from storage.drift_views import VIEWS as DRIFT_VIEWS
from storage.images import IMAGES
from storage.label_views import VIEWS as LABEL_VIEWS
from storage.loop_views import VIEWS as LOOP_VIEWS
from storage.parquet import DataStore
from storage.schema import TABLES
from storage.settings import Settings

ALLOWED = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}


class RefusedStatement(Exception):
    """A statement the sandbox does not run (anything but SELECT/EXPLAIN)."""


class QueryTimeout(Exception):
    pass


@dataclass
class Views:
    con: duckdb.DuckDBPyConnection
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, reason) of unreadable files
    # What the views were made from, local files only: each file's stamp taken before it was read, and the
    # stored images listed (`ViewCache` reuses the views while these and the catalog snapshots are unchanged).
    stamps: dict[str, tuple[int, int, int] | None] = field(default_factory=dict)
    images: list[str] = field(default_factory=list)
    # kind -> (the files of its complete artifacts, the unreadable ones among them with their reasons): what its
    # view was made from, so `refresh_views` remakes only the views whose files changed.
    kinds: dict[str, tuple[list[str], list[tuple[str, str]]]] = field(default_factory=dict)


def _stamp(path: str | Path) -> tuple[int, int, int] | None:
    """(inode, mtime, size) of a local file; None if it is missing. A replaced or rewritten file changes it."""
    try:
        st = Path(path).stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _snapshot_stamps(settings: Settings) -> tuple:
    return tuple(_stamp(settings.snapshot_dir / f"{table}.parquet") for table in DDL)


def _image_files(images_dir: Path) -> list[str]:
    return sorted(str(p) for p in images_dir.glob("*/*.parquet")) if images_dir.is_dir() else []


class ViewCache:
    """`Workspace.query`'s views, brought up to date only when what they read changed.

    Making the views (a DuckDB connection, the catalog snapshots copied in, every registered file's footer
    checked, ~20 views) took ~90 ms on a small workspace, for every query; stage code and tests query often.
    The views are reused while the catalog's snapshots (each replaced whole on every catalog change), every
    file they read (inode, mtime, size) and the list of stored images are unchanged; after a change only what
    changed is made again on the same connection (`refresh_views`: ~33 against ~99 ms on a 120-file workspace after
    a batch is added, measured), so a query sees exactly what fresh views would. One query at a time per cache (a
    DuckDB connection is not for concurrent use). Object-store workspaces make their views per query, as before."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._local = DataStore(settings.data_root).local
        self._lock = threading.Lock()
        self._views: Views | None = None
        self._snapshots: tuple = ()

    def query(self, sql: str, params: list | dict | None = None) -> pa.Table:
        with self._lock:
            views = self._current()
            try:
                return views.con.sql(sql, params=params).to_arrow_table()
            finally:
                if not self._local:
                    self.close()

    def _current(self) -> Views:
        snapshots = _snapshot_stamps(self.settings)  # taken before the views read them: a change meanwhile shows next time
        v = self._views
        if v is None:
            self._snapshots, self._views = snapshots, open_views(self.settings)
            return self._views
        tables = [t for t, old, new in zip(DDL, self._snapshots, snapshots) if old != new]
        if tables or v.images != _image_files(self.settings.images_dir) or any(
                _stamp(p) != stamp for p, stamp in v.stamps.items()):
            self._snapshots = snapshots
            try:
                refresh_views(v, self.settings, tables)
            except BaseException:
                self.close()  # half brought up to date: made anew by the next query
                raise
        return v

    def close(self) -> None:
        if self._views is not None:
            self._views.con.close()
            self._views = None


def _sql_list(paths: list[str]) -> str:
    return "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"


def open_views(settings: Settings, config: dict[str, str] | None = None) -> Views:
    """In-memory DuckDB with the workspace views and catalog tables (not locked down)."""
    con = duckdb.connect(":memory:", config=config or {})
    views = Views(con)
    for table in DDL:
        _load_table(con, settings, table)
    for kind, schema in TABLES.items():
        # An empty table with the current schema under every view: a column that older files lack
        # (e.g. rollouts.segment_starts before schema version 2) reads as NULL instead of missing.
        con.register(f"_empty_{kind}", pa.Table.from_batches([], schema=schema))
        con.execute(f"CREATE TABLE _{kind} AS SELECT * FROM _empty_{kind}")
        con.unregister(f"_empty_{kind}")
    _file_views(views, DataStore(settings.data_root))
    for name, sql in (LABEL_VIEWS | LOOP_VIEWS | DRIFT_VIEWS).items():
        con.execute(f"CREATE VIEW {name} AS {sql}")
    views.images = _images_view(con, settings.images_dir)
    return views


def refresh_views(views: Views, settings: Settings, tables: list[str]) -> None:
    """Bring `views` (made by `open_views` on a local workspace) up to what fresh views would show: the catalog tables
    in `tables` loaded again from their snapshots, the view of every kind whose files changed (which, or any one's
    stamp) made again, and the images view if the stored images changed. The label views read the others by name,
    so they need nothing."""
    for table in tables:
        _load_table(views.con, settings, table)
    _file_views(views, DataStore(settings.data_root))
    if views.images != _image_files(settings.images_dir):
        views.images = _images_view(views.con, settings.images_dir)


def _load_table(con: duckdb.DuckDBPyConnection, settings: Settings, table: str) -> None:
    """The catalog table `table` as its snapshot has it (empty before the catalog's first write), with every column the
    catalog defines: one a snapshot written before the column was added (storage/catalog_ddl.py `ADDED_COLUMNS`)
    reads as NULL until the table's next write, so the views over it can always be made."""
    snap = settings.snapshot_dir / f"{table}.parquet"
    con.execute(f"CREATE OR REPLACE TABLE {table} ({DDL[table]})")
    if snap.exists():  # not DuckDB's read_parquet: it opens the file twice, and a run may replace it between
        con.register("_snapshot", read_snapshot(snap))
        con.execute(f"CREATE OR REPLACE TABLE {table} AS SELECT * FROM {table} UNION ALL BY NAME SELECT * FROM _snapshot")
        con.unregister("_snapshot")


def _file_views(views: Views, data: DataStore) -> None:
    """Each kind's view over the files of its complete artifacts (per the `files` and `artifacts` tables), each file's
    footer checked: a damaged file is named (`views.skipped`) and left out, the rest stays queryable. A kind whose
    files, and each one's stamp, are what its view was made from keeps its view; a file read before at its current stamp
    keeps its verdict."""
    con, stamps, skipped = views.con, {}, []
    for kind, schema in TABLES.items():
        view = "_labels_rows" if kind == "labels" else kind  # `labels` adds `current` (storage/label_views.py)
        paths = [
            p for (p,) in con.execute(
                "SELECT f.path FROM files f JOIN artifacts a USING (artifact_id) "
                "WHERE a.status = 'complete' AND f.kind = ? ORDER BY f.path", [kind]
            ).fetchall()
        ]
        now = {p: _stamp(p) for p in paths} if data.local else {}  # each taken before the file is read
        made_paths, made_bad = views.kinds.get(kind, ([], []))
        same = {p for p in made_paths if p in now and views.stamps.get(p) == now[p]}  # checked before, unchanged since
        if made_paths == paths and len(same) == len(paths) and kind in views.kinds:
            stamps.update(now)
            skipped += made_bad
            continue
        readable, bad, reasons = [], [], dict(made_bad)
        for p in paths:
            if p in same:  # its footer was read at this stamp: the same verdict
                (bad.append((p, reasons[p])) if p in reasons else readable.append(p))
                continue
            try:
                data.footer(p)
                readable.append(p)
            except Exception as e:  # noqa: BLE001 - any reader error means this one file is unusable
                bad.append((p, f"{type(e).__name__}: {e}"))
        if readable and data.local:
            con.execute(f"CREATE OR REPLACE VIEW {view} AS SELECT * FROM _{kind} UNION ALL BY NAME "
                        f"SELECT * FROM read_parquet({_sql_list(readable)}, union_by_name=true)")
        elif readable:  # object storage: pyarrow scans, DuckDB never opens a remote path itself
            con.register(f"_{kind}_files", data.dataset(readable, schema))
            con.execute(f"CREATE OR REPLACE VIEW {view} AS SELECT * FROM _{kind} UNION ALL BY NAME "
                        f"SELECT * FROM _{kind}_files")
        else:
            con.execute(f"CREATE OR REPLACE VIEW {view} AS SELECT * FROM _{kind}")
        views.kinds[kind] = (paths, bad)
        stamps.update(now)
        skipped += bad
    views.stamps, views.skipped = stamps, skipped


def _images_view(con: duckdb.DuckDBPyConnection, images_dir: Path) -> list[str]:
    """The `images` view: one row per stored image (an empty table with the schema when there are none).
    The files are listed here, not globbed by DuckDB, so a writer's hidden temp file is never read. Returns them."""
    paths = _image_files(images_dir)
    con.register("_empty_images", pa.Table.from_batches([], schema=IMAGES))
    con.execute("CREATE OR REPLACE TABLE _images AS SELECT * FROM _empty_images")
    con.unregister("_empty_images")
    source = f" UNION ALL BY NAME SELECT * FROM read_parquet({_sql_list(paths)})" if paths else ""
    con.execute(f"CREATE OR REPLACE VIEW images AS SELECT * FROM _images{source}")
    return paths


class Sandbox:
    """A locked-down read-only SQL session over one workspace."""

    def __init__(self, settings: Settings, memory_limit: str = "2GB", timeout_s: float = 60.0, threads: int = 2):
        self.timeout_s = timeout_s
        views = open_views(settings, config={"threads": threads})
        self.con, self.skipped = views.con, views.skipped
        local = "://" not in settings.data_root
        # A local data root is read by DuckDB; a remote one only through the registered datasets.
        allowed = [f"{Path(settings.data_root).resolve()}/"] if local else []
        allowed.append(f"{settings.images_dir.resolve()}/")  # the image store is always local (storage/images.py)
        for stmt in (
            f"SET allowed_directories={_sql_list(allowed)}",
            "SET enable_external_access=false",
            "SET autoinstall_known_extensions=false",
            "SET autoload_known_extensions=false",
            "SET allow_community_extensions=false",
            f"SET memory_limit='{memory_limit}'",
            "SET lock_configuration=true",
        ):
            self.con.execute(stmt)

    def query(self, sql: str, params: list | dict | None = None) -> pa.Table:
        """Run SELECT/EXPLAIN statements; return the last one's result. `params` fill the placeholders of a single
        statement (a task's filter written by a person goes in `sql`, the values it is compared with here).

        Raises RefusedStatement for any other statement (before running anything),
        QueryTimeout past the timeout, duckdb.Error for bad SQL.
        """
        statements = duckdb.extract_statements(sql)
        if not statements:
            raise RefusedStatement("no statement given")
        for s in statements:
            if s.type not in ALLOWED:
                kind = str(s.type).split(".")[-1]
                raise RefusedStatement(f"refused: {kind} statements are not allowed (read-only; SELECT only): {s.query.strip()[:80]}")
        timer = threading.Timer(self.timeout_s, self.con.interrupt)
        timer.start()
        try:
            result = None
            if params is not None and len(statements) != 1:
                raise RefusedStatement("parameters fill one statement; got several")
            for s in statements:
                result = self.con.sql(s.query, params=params).to_arrow_table()
            return result
        except duckdb.InterruptException as e:
            raise QueryTimeout(f"query interrupted after {self.timeout_s:.0f} s") from e
        finally:
            timer.cancel()

    def warn_skipped(self) -> None:
        for path, reason in self.skipped:
            print(f"warning: skipped unreadable Parquet file {path}: {reason}", file=sys.stderr)
