"""Which checkpoint a policy reference names: the one home for that decision (`rlops serve`, `rlops export`,
`rlops promote`).

    row = find_checkpoint(checkpoints_file, "ck-1a2b...")              # a checkpoint id
    row = find_checkpoint(checkpoints_file, "nightly@latest")           # a run's newest trained checkpoint
    row = find_checkpoint(checkpoints_file, "nightly@champion", registry)  # a registered model's alias
    row = find_checkpoint(checkpoints_file, "models:/nightly/3", registry)  # ... or version (also models:/N@ALIAS)

Rows come from the catalog's Parquet snapshot (kept current by a running pipeline, readable without a lock);
registered versions from MLflow's model registry (storage/registry.py), read on every call, so an alias moved
meanwhile is followed. `base` (a base model without adapter) is the caller's to handle: it names no row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from storage.registry import ModelRef, Registry


def checkpoint_rows(checkpoints_file: Path) -> list[dict[str, Any]]:
    """Every checkpoint of the snapshot, oldest first."""
    from storage.catalog import read_snapshot

    if not checkpoints_file.exists():
        return []
    cols = ["policy_id", "base_model", "kind", "adapter_uri", "run_name", "created_at"]
    return sorted(read_snapshot(checkpoints_file, cols).to_pylist(), key=lambda r: r["created_at"])


def find_checkpoint(checkpoints_file: Path, name: str, registry: Registry | None = None) -> dict[str, Any]:
    """The checkpoint row `name` names (see the module docstring); KeyError saying why there is none. A registry
    reference's row also carries `registered`: the registry Version it came through."""
    ref = ModelRef.parse(name)
    if ref is not None:
        if registry is None:
            raise KeyError(f"{name!r} names a registered model, and this workspace has no MLflow registry yet")
        version = registry.resolve(ref)
        row = next((r for r in checkpoint_rows(checkpoints_file) if r["policy_id"] == version.policy_id), None)
        if row is None:
            raise KeyError(f"{ref} is version {version.version}, policy {version.policy_id}, which is not in this "
                           "workspace's catalog")
        return {**row, "registered": version}
    table = checkpoint_rows(checkpoints_file)
    if name.endswith("@latest"):
        run = name[: -len("@latest")]
        trained = [r for r in table if r["run_name"] == run and r["kind"] != "base"]
        if not trained:
            raise KeyError(f"run {run!r} has no trained checkpoint in this workspace")
        return trained[-1]
    row = next((r for r in table if r["policy_id"] == name), None)
    if row is None:
        raise KeyError(f"unknown model {name!r}: not a checkpoint id, 'base', 'RUN@latest', 'NAME@ALIAS' or "
                       "'models:/NAME@ALIAS'")
    return row
