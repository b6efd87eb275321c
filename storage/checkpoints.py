"""Checkpoints on object storage: adapters uploaded after the local atomic write, downloaded to a
local cache before loading.

    uri = publish(settings, final_dir)     # the adapter_uri to register: the folder, or s3://.../checkpoints/<id>
    path = local_copy(uri)                 # a local folder for from_pretrained (a no-op for a local path)

With a local data root a checkpoint stays where it was written (`<workspace>/checkpoints/<id>`). With an
object-store data root it is also uploaded to `<data_root>/checkpoints/<id>/`, every file first and a
`_COMPLETE` marker last, and the catalog registers that URI: any node with the credentials can load
it, and a killed upload (no marker) is never loaded. `local_copy` downloads a folder once into
`$RLOPS_CACHE/checkpoints/<id>` (atomically: a folder there is whole), so every worker process on a
node reads the same copy. Checkpoint folders are immutable once registered (ids are content hashes).
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.fs as pafs

from storage.atomic import atomic_dir
from storage.settings import Settings

MARKER = "_COMPLETE"


def publish(settings: Settings, folder: Path) -> str:
    """Upload a complete local checkpoint folder when the data root is remote; return its adapter_uri."""
    if "://" not in settings.data_root:
        return str(folder)
    fs, base = pafs.FileSystem.from_uri(settings.data_root)
    scheme = settings.data_root.split("://", 1)[0]
    target = f"{base.rstrip('/')}/checkpoints/{folder.name}"
    fs.create_dir(target, recursive=True)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    for path in files:
        pafs.copy_files(str(path), f"{target}/{path.relative_to(folder).as_posix()}",
                        source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    with fs.open_output_stream(f"{target}/{MARKER}") as f:  # last: the folder is complete
        f.write(b"\n".join(p.relative_to(folder).as_posix().encode() for p in files))
    return f"{scheme}://{target}"


def local_copy(uri: str | None) -> str | None:
    """A local folder holding the checkpoint at `uri` (downloaded once per machine), or `uri` if local."""
    if uri is None or "://" not in uri:
        return uri
    fs, path = pafs.FileSystem.from_uri(uri)
    cache = Path(os.environ.get("RLOPS_CACHE", Path.home() / ".cache" / "rlops")).expanduser()
    local = cache / "checkpoints" / Path(path).name
    if (local / MARKER).exists():
        return str(local)
    try:
        with fs.open_input_stream(f"{path}/{MARKER}") as f:
            names = f.read().decode().splitlines()
    except FileNotFoundError as e:
        raise FileNotFoundError(f"checkpoint {uri} is incomplete (no {MARKER}): its upload did not finish") from e
    with atomic_dir(local) as tmp:
        for name in names:
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            pafs.copy_files(f"{path}/{name}", str(tmp / name), source_filesystem=fs,
                            destination_filesystem=pafs.LocalFileSystem())
        (tmp / MARKER).write_text("\n".join(names))
    return str(local)
