"""Atomic Parquet files under the data root.

Layout: `<data_root>/<kind>/<artifact_id>/<part>.parquet`, one folder per artifact (a batch
may have several parts, e.g. one per rollout group shard). A file is written under a hidden
temporary name, flushed and fsynced, then renamed: readers never see a partial file, and a
crash leaves at most a `.tmp` file that no reader lists. The catalog registers a file only
after `write` returns.

The data root may be object storage (`s3://bucket/prefix`, any pyarrow filesystem URI), with the
endpoint and credentials from the environment only (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_DEFAULT_REGION`, or the usual AWS profile files): the URI never
carries a secret, and the catalog records plain `s3://` paths. There a "rename" is a server-side
copy: an object appears whole or not at all (an upload that never completes leaves nothing), and
what readers see is still decided by the catalog, which registers only complete parts.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from storage.atomic import atomic_file
from storage.schema import TABLES

if TYPE_CHECKING:
    import pyarrow.dataset


@dataclass(frozen=True)
class FileInfo:
    path: str  # absolute local path or URI, as registered in the catalog
    rows: int
    bytes: int


class DataStore:
    """Reads and writes the Parquet tables on a local folder or any pyarrow filesystem."""

    def __init__(self, root: str):
        if "://" in root:
            self.fs, base = pafs.FileSystem.from_uri(root)
            self.local = False
        else:
            self.fs, base = pafs.LocalFileSystem(), str(Path(root).resolve())
            self.local = True
        self.root = root
        self.base = base.rstrip("/")

    def artifact_dir(self, kind: str, artifact_id: str) -> str:
        return f"{self.base}/{kind}/{artifact_id}"

    def write(self, kind: str, artifact_id: str, table: pa.Table, part: str | None = None) -> FileInfo:
        """Write `table` atomically as one part of an artifact; return what to register.

        `part` names the file (e.g. a group shard); rewriting the same part replaces it whole.
        The table must match the kind's schema exactly (that is the data contract).
        """
        schema = TABLES[kind]
        if not table.schema.equals(schema):
            table = table.cast(schema)  # raises on a column mismatch rather than writing a bad file
        folder = self.artifact_dir(kind, artifact_id)
        name = f"{part or 'part-' + uuid.uuid4().hex[:12]}.parquet"
        final = f"{folder}/{name}"
        self.fs.create_dir(folder, recursive=True)
        if self.local:
            with atomic_file(final) as f:
                pq.write_table(table, f, compression="zstd")
        else:
            tmp = f"{folder}/.{name}.{uuid.uuid4().hex[:8]}.tmp"  # hidden and not *.parquet: no glob sees it
            try:
                # Closing the stream completes the upload even after an error: write to a temp key,
                # and copy it to the final key only once the table is entirely written.
                with self.fs.open_output_stream(tmp) as f:
                    pq.write_table(table, f, compression="zstd")
                self.fs.move(tmp, final)
            except BaseException:
                try:
                    self.fs.delete_file(tmp)
                except OSError:  # never created, or already moved
                    pass
                raise
        size = self.fs.get_file_info(final).size
        return FileInfo(path=final if self.local else f"{self.root.split('://')[0]}://{final}", rows=table.num_rows, bytes=size)

    def read(self, paths: list[str], columns: list[str] | None = None) -> pa.Table:
        """Read registered files into one table (in the given order)."""
        tables = [pq.read_table(self._path(p), columns=columns, filesystem=self.fs) for p in paths]
        if not tables:
            raise ValueError("no files to read")
        return pa.concat_tables(tables)

    def footer(self, path: str) -> pq.FileMetaData:
        """A registered file's Parquet footer (raises if the file is missing or damaged)."""
        return pq.read_metadata(self._path(path), filesystem=self.fs)

    def dataset(self, paths: list[str], schema: pa.Schema) -> "pyarrow.dataset.Dataset":
        """The given files as one pyarrow dataset with `schema` (columns a file lacks read as null)."""
        import pyarrow.dataset as ds

        return ds.dataset([self._path(p) for p in paths], schema=schema, format="parquet", filesystem=self.fs)

    def delete(self, path: str) -> bool:
        """Remove a data file (a traffic part a merge replaced, a file forgetting emptied); False if it was gone."""
        try:
            self.fs.delete_file(self._path(path))
        except FileNotFoundError:
            return False
        return True

    def _path(self, path: str) -> str:
        return path.split("://", 1)[1] if "://" in path else path

