"""Atomic local writes: a file or folder appears whole under its final name, or not at all.

    with atomic_file(path) as f:          # a hidden temp file in the same folder, fsynced, renamed
        f.write(data)
    write_text_atomic(path, text)         # the same for a string
    with atomic_path(path) as tmp:        # a temp name, for a writer that opens the file itself
        writer.write(tmp)
    with atomic_dir(final) as tmp:        # a temp folder next to `final`, renamed onto it at the end
        model.save_pretrained(tmp)

Temp names start with "." and end in ".tmp", so no reader's glob (`*.parquet`, `*.json`) sees them.
A write that fails (a full disk, a file-size limit) removes its temp and raises `WriteError`,
which names the final path; nothing partial is left under that name. Temp folders left by killed
processes (their pid is in the name) are removed by the next `atomic_dir` of the same target.
One home for the temp-then-rename pattern: every writer in the tree goes through here.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


class WriteError(OSError):
    """A write failed; the message names the final path and the reason (e.g. 'No space left on device')."""


def write_error(path: Path | str, e: OSError) -> WriteError:
    """`e` as a WriteError naming `path` and the reason."""
    reason = e.strerror or (os.strerror(e.errno) if e.errno else str(e))
    return WriteError(e.errno or errno.EIO, f"cannot write {path}: {reason}")


def fsync_dir(folder: Path | str) -> None:
    """Make a rename inside `folder` durable (POSIX; a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: Path | str, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temp file next to `path` for writing; on success flush, fsync and rename it onto `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise (e if isinstance(e, WriteError) else write_error(path, e)) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """A temp file name next to `path`, for a writer that opens the file itself (the gguf package's): when the
    block ends the file is fsynced and renamed onto `path`; on failure it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise (e if isinstance(e, WriteError) else write_error(path, e)) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: Path | str, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically."""
    with atomic_file(path, "w") as f:
        f.write(text)


def copy_if_absent(src: Path | str, dst: Path | str) -> None:
    """Copy `src` to `dst` unless `dst` exists: copied beside it, then linked into place, so `dst` is whole or
    absent, and a file another process made there meanwhile is kept (a template database copied into a new
    workspace: storage/tracking.py, flows/prefect_db.py)."""
    dst = Path(dst)
    copy = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        shutil.copyfile(src, copy)
        try:
            os.link(copy, dst)
        except FileExistsError:
            pass
    finally:
        copy.unlink(missing_ok=True)


def _clear_stale(final: Path) -> None:
    """Remove temp folders of `final` whose writing process is gone (a killed run)."""
    for tmp in final.parent.glob(f".{final.name}.tmp-*"):
        try:
            os.kill(int(tmp.name.rsplit("-", 1)[1]), 0)
        except (ProcessLookupError, ValueError):
            shutil.rmtree(tmp, ignore_errors=True)
        except PermissionError:  # alive, owned by another user
            pass


@contextmanager
def atomic_dir(final: Path | str) -> Iterator[Path]:
    """Yield an empty temp folder next to `final`; when the block ends, replace `final` with it.

    A complete folder may already sit under the final name (a forced rerun, or a run killed after
    the rename but before registering it): it is replaced whole. On failure the temp is removed.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    _clear_stale(final)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        shutil.rmtree(final, ignore_errors=True)  # a directory rename needs an absent target
        os.replace(tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise (e if isinstance(e, WriteError) else write_error(final, e)) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(final.parent)
