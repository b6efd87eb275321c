"""Which policy a request's `model` names: a checkpoint id, `base` or `RUN@latest` from a workspace's
catalog (`rlops serve`), or the one policy of a rollout (an external agent's shard).

A resolver maps a model name to (policy id, adapter folder or None for the base) and raises KeyError
for an unknown name; it comes with a function listing the names it serves (`GET /v1/models`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

# A model name -> (policy id, adapter folder or None for the base). Raises KeyError when unknown.
Resolver = Callable[[str], tuple[str, str | None]]


def _checkpoints(checkpoints_file: Path) -> list[dict[str, Any]]:
    from storage.catalog import read_snapshot

    if not checkpoints_file.exists():
        return []
    cols = ["policy_id", "base_model", "kind", "adapter_uri", "run_name", "created_at"]
    return sorted(read_snapshot(checkpoints_file, cols).to_pylist(), key=lambda r: r["created_at"])


def find_checkpoint(checkpoints_file: Path, name: str) -> dict[str, Any]:
    """The checkpoint row a policy id or `RUN@latest` (the run's newest trained checkpoint) names,
    from the catalog's Parquet snapshot (kept current by a running pipeline, readable without a lock)."""
    table = _checkpoints(checkpoints_file)
    if name.endswith("@latest"):
        run = name[: -len("@latest")]
        trained = [r for r in table if r["run_name"] == run and r["kind"] != "base"]
        if not trained:
            raise KeyError(f"run {run!r} has no trained checkpoint in this workspace")
        return trained[-1]
    row = next((r for r in table if r["policy_id"] == name), None)
    if row is None:
        raise KeyError(f"unknown model {name!r}: not a checkpoint id, 'base' or 'RUN@latest'")
    return row


def catalog_resolver(checkpoints_file: Path, base_model: str) -> tuple[Resolver, Callable[[], list[str]]]:
    """Resolve `model` names against a workspace's checkpoints: a policy id, `base`, or `RUN@latest`.
    Only checkpoints of `base_model` can be served. Read on every request, so checkpoints written
    after the server started are served without a restart."""

    def resolve(name: str) -> tuple[str, str | None]:
        if name == "base":
            return "base", None
        row = find_checkpoint(checkpoints_file, name)
        if row["base_model"] != base_model:
            raise KeyError(f"{row['policy_id']} is trained on {row['base_model']!r}; this server serves {base_model!r}")
        if row["adapter_uri"] and not Path(row["adapter_uri"]).exists():
            raise KeyError(f"the adapter files of {row['policy_id']} are missing: {row['adapter_uri']}")
        return row["policy_id"], row["adapter_uri"]

    def names() -> list[str]:
        table = [r for r in _checkpoints(checkpoints_file) if r["kind"] != "base" and r["base_model"] == base_model]
        runs = sorted({r["run_name"] for r in table if r["run_name"]})
        return ["base"] + [r["policy_id"] for r in table] + [f"{run}@latest" for run in runs]

    return resolve, names


def fixed_resolver(policy_id: str, adapter_dir: str | None) -> tuple[Resolver, Callable[[], list[str]]]:
    """Serve exactly one policy (the rollout stage's), named by its id."""

    def resolve(name: str) -> tuple[str, str | None]:
        if name != policy_id:
            raise KeyError(f"unknown model {name!r}: this rollout serves {policy_id!r} (the `model` argument)")
        return policy_id, adapter_dir

    return resolve, lambda: [policy_id]
