"""Tabular data read where it lies: Parquet, JSONL, JSON, CSV and Arrow files, folders and globs of them,
and `datasets` datasets (a `save_to_disk` folder, or a `load_dataset` builder over local files).

    sources = open_sources("data/gsm8k/*.parquet")      # {None: Rows}, or {split: Rows} for a DatasetDict
    rows = sources[None]
    rows.num_rows, rows.schema                           # from the files' metadata: no row is read
    rows.column("split")                                 # one column, whole, as Arrow (not Python objects)
    rows.take([0, 1, 7])                                 # those rows only, as a pyarrow Table

Parquet is read lazily: the row count and schema come from the footers, a column is read alone, and `take`
streams only the row groups that hold the rows asked for, a batch at a time, stopping after the last one. So
a 1,000,000-row file costs its footer to open and a few batches to sample from (bench/bench_dataset.py).
The other formats are read whole into Arrow memory (columnar, not Python objects). Nothing here imports
torch; `datasets` is imported only for a `datasets` folder or builder.

Any file that cannot be read is a `DataFileError` naming the file and the reason.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa

SUFFIXES = {".parquet": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv",
            ".tsv": "tsv", ".arrow": "arrow"}
STREAM_BATCH = 4096  # rows decoded at a time when streaming a Parquet row group: bounds take()'s memory


class DataFileError(ValueError):
    """A data file or folder that cannot be read; the message names it and says why."""


class Rows(Protocol):
    """Rows of one table, read on demand."""

    schema: pa.Schema
    num_rows: int

    def column(self, name: str) -> pa.ChunkedArray: ...

    def take(self, indices: Sequence[int]) -> pa.Table: ...


class TableRows:
    """Rows already in Arrow memory (JSON, CSV, Arrow files, a `datasets` dataset's memory-mapped table)."""

    def __init__(self, table: pa.Table) -> None:
        self.table, self.schema, self.num_rows = table, table.schema, table.num_rows

    def column(self, name: str) -> pa.ChunkedArray:
        return self.table.column(name)

    def take(self, indices: Sequence[int]) -> pa.Table:
        return self.table.take(pa.array(indices, type=pa.int64()))


class ParquetRows:
    """Rows of Parquet files in order, read lazily (footers at open, row groups on demand)."""

    def __init__(self, paths: list[Path]) -> None:
        import pyarrow.parquet as pq

        self.files = []
        for path in paths:
            try:
                self.files.append(pq.ParquetFile(path))
            except (OSError, pa.ArrowException) as e:
                raise DataFileError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from e
        self.paths = paths
        schemas = [f.schema_arrow for f in self.files]
        self.schema = schemas[0]
        for path, schema in zip(paths[1:], schemas[1:]):
            if schema.names != self.schema.names:
                raise DataFileError(f"{path}: columns {schema.names} differ from {paths[0]}'s {self.schema.names}")
        # (file, row group) -> first global row, in order: where each row group starts
        self.starts: list[tuple[int, int, int, int]] = []  # (global start, n rows, file index, row group)
        at = 0
        for fi, f in enumerate(self.files):
            for rg in range(f.metadata.num_row_groups):
                n = f.metadata.row_group(rg).num_rows
                self.starts.append((at, n, fi, rg))
                at += n
        self.num_rows = at

    def column(self, name: str) -> pa.ChunkedArray:
        return pa.chunked_array([c for f in self.files for c in f.read(columns=[name]).column(0).chunks],
                                type=self.schema.field(name).type)

    def take(self, indices: Sequence[int]) -> pa.Table:
        """The rows at `indices` (any order, repeats allowed), in that order: each row group holding one is
        streamed a batch at a time up to its last wanted row, so memory stays at a batch whatever the file."""
        wanted = sorted(set(int(i) for i in indices))
        if wanted and not 0 <= wanted[0] <= wanted[-1] < self.num_rows:
            raise IndexError(f"row index out of range (0..{self.num_rows - 1})")
        found: dict[int, pa.Table] = {}
        k = 0
        for start, n, fi, rg in self.starts:
            if k == len(wanted):
                break
            if wanted[k] >= start + n:
                continue
            at = start
            for batch in self.files[fi].iter_batches(batch_size=STREAM_BATCH, row_groups=[rg]):
                end = at + batch.num_rows
                while k < len(wanted) and wanted[k] < end:
                    found[wanted[k]] = pa.Table.from_batches([batch.slice(wanted[k] - at, 1)])
                    k += 1
                at = end
                if k == len(wanted) or wanted[k] >= start + n:
                    break
        if not found:
            return self.schema.empty_table()
        return pa.concat_tables([found[int(i)] for i in indices])


def open_sources(path: str | Path, builder: str | None = None) -> dict[str | None, Rows]:
    """The rows at `path`: a file, a folder of files, a glob, or a `datasets` `save_to_disk` folder; with
    `builder`, `datasets.load_dataset(builder, data_files=path)` (e.g. "json", "csv", "parquet").

    Returns {None: rows} for one table, or {split: rows} where the source itself is split (a DatasetDict,
    or a folder whose files are named by split: train.parquet, test.parquet, ...)."""
    if builder is not None:
        return _load_builder(builder, str(path))
    p = Path(path).expanduser()
    if p.is_dir():
        if (p / "dataset_dict.json").exists() or (p / "state.json").exists():
            return _load_from_disk(p)
        files = sorted(f for f in p.iterdir() if f.is_file() and _kind(f) is not None)
        if not files:
            raise DataFileError(f"{p}: no data files in the folder (looked for {', '.join(SUFFIXES)})")
        by_split = {f.name.split(".", 1)[0]: f for f in files}
        if len(by_split) == len(files) and set(by_split) <= SPLIT_NAMES:
            return {split: read_files([f]) for split, f in sorted(by_split.items())}
        return {None: read_files(files)}
    if glob.has_magic(str(p)):
        files = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
        if not files:
            raise DataFileError(f"{path}: the glob matches no file")
        return {None: read_files(files)}
    if not p.exists():
        raise DataFileError(f"{p}: no such file or folder")
    return {None: read_files([p])}


SPLIT_NAMES = {"train", "test", "validation", "valid", "dev", "eval"}


def read_files(files: list[Path]) -> Rows:
    """One table from `files` of one kind (by suffix): Parquet lazily, the others whole in Arrow memory."""
    kinds = {_kind(f) for f in files}
    if None in kinds:
        bad = next(f for f in files if _kind(f) is None)
        raise DataFileError(f"{bad}: unknown data file type (expected one of {', '.join(SUFFIXES)})")
    if len(kinds) > 1:
        raise DataFileError(f"files of several kinds ({', '.join(sorted(kinds))}): give one kind per dataset")
    kind = kinds.pop()
    if kind == "parquet":
        return ParquetRows(files)
    tables = [_read_whole(f, kind) for f in files]
    try:
        return TableRows(pa.concat_tables(tables, promote_options="default"))
    except pa.ArrowException as e:
        raise DataFileError(f"files {', '.join(map(str, files))} do not share one schema: {e}") from e


def _kind(path: Path) -> str | None:
    return SUFFIXES.get(path.suffix.lower())


def _read_whole(path: Path, kind: str) -> pa.Table:
    try:
        if kind == "csv" or kind == "tsv":
            import pyarrow.csv as pcsv

            return pcsv.read_csv(path, parse_options=pcsv.ParseOptions(delimiter="\t" if kind == "tsv" else ","))
        if kind == "arrow":
            return _read_arrow(path)
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, pa.ArrowException) as e:
        raise DataFileError(f"{path}: cannot read it ({type(e).__name__}: {e})") from e
    if kind == "json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataFileError(f"{path}: not valid JSON ({e})") from e
        if not all(isinstance(r, dict) for r in rows):
            raise DataFileError(f"{path}: a JSON file must hold a list of objects (one per row)")
    else:  # JSON lines (a .json file that is not one array is read as JSON lines, as `datasets` does)
        rows = []
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataFileError(f"{path}:{n}: not valid JSON ({e})") from e
            if not isinstance(row, dict):
                raise DataFileError(f"{path}:{n}: a JSON line must be an object, got {type(row).__name__}")
            rows.append(row)
    try:
        return pa.Table.from_pylist(rows)
    except pa.ArrowException as e:
        raise DataFileError(f"{path}: rows of different shapes ({e})") from e


def _read_arrow(path: Path) -> pa.Table:
    # `datasets` writes Arrow stream files; other tools write the file (random access) format
    with pa.memory_map(str(path)) as source:
        try:
            return pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            source.seek(0)
            return pa.ipc.open_file(source).read_all()


def _dataset_rows(ds: Any) -> Rows:
    """A `datasets.Dataset`'s rows as Arrow, without turning them into Python objects (an indices mapping,
    left by select/shuffle, is applied)."""
    if ds._indices is not None:  # noqa: SLF001 - the public way (flatten_indices) writes a cache file
        return TableRows(ds.data.table.take(ds._indices.column(0)))  # noqa: SLF001
    return TableRows(ds.data.table)


def _datasets() -> Any:
    from storage.settings import no_telemetry

    no_telemetry()  # before `datasets` reads its switches at import
    import datasets

    return datasets


def _load_from_disk(folder: Path) -> dict[str | None, Rows]:
    datasets = _datasets()

    try:
        loaded = datasets.load_from_disk(str(folder))
    except Exception as e:  # noqa: BLE001 - whatever `datasets` raises, the folder is the problem to report
        raise DataFileError(f"{folder}: not a readable `datasets` folder ({type(e).__name__}: {e})") from e
    if isinstance(loaded, datasets.DatasetDict):
        return {split: _dataset_rows(ds) for split, ds in loaded.items()}
    return {None: _dataset_rows(loaded)}


def _load_builder(builder: str, data_files: str) -> dict[str | None, Rows]:
    datasets = _datasets()

    try:
        loaded = datasets.load_dataset(builder, data_files=data_files)
    except Exception as e:  # noqa: BLE001
        raise DataFileError(f"datasets.load_dataset({builder!r}, data_files={data_files!r}) failed: "
                            f"{type(e).__name__}: {e}") from e
    return {split: _dataset_rows(ds) for split, ds in loaded.items()}


_FINGERPRINTS: dict[tuple[str, int, int], str] = {}


def fingerprint(path: str | Path) -> str:
    """16 hex digits of sha256 over the content of every file at `path` (a file, a folder's files, a glob),
    with their names relative to it: what the data is, not where it lies. Cached per file by size and mtime."""
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
        base = p
    elif glob.has_magic(str(p)):
        files = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
        base = Path(os.path.commonpath([str(f.parent) for f in files])) if files else p.parent
    else:
        files, base = [p], p.parent
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(base)).encode() + b"\0" + _file_digest(f).encode())
    return h.hexdigest()[:16]


def _file_digest(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _FINGERPRINTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        _FINGERPRINTS[key] = h.hexdigest()
    return _FINGERPRINTS[key]
