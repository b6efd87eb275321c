"""Workspace settings: where data, catalog, MLflow and Prefect live.

Everything that differs between a laptop and a cluster is here, as a path or a URI:
`data_root` may be an object-store URI (`s3://bucket/rlops`), `mlflow_uri` a remote
tracking server. Code never builds these paths itself; it asks a `Workspace`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

DEFAULT_WORKSPACE = "rlops-workspace"

# Usage reports the libraries rlops drives send by default, each switched off (found by the test suite's
# network guard, tests/netguard.py): a run sends nothing to anything but the services it is configured
# to use. `setdefault`: a user's own setting wins.
NO_TELEMETRY = {
    "MLFLOW_DISABLE_TELEMETRY": "true",  # MLflow 3: config.mlflow-telemetry.io, from `import mlflow` on
    "RAY_USAGE_STATS_ENABLED": "0",  # Ray: usage-stats.ray.io
    "HF_HUB_DISABLE_TELEMETRY": "1",  # huggingface_hub: a HEAD to huggingface.co when TRL's trainers start
    "OPENAI_AGENTS_DISABLE_TRACING": "1",  # OpenAI Agents SDK in user agents: traces to api.openai.com
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # LiteLLM in user agents: its price map from GitHub at import
    "HF_UPDATE_DOWNLOAD_COUNTS": "false",  # datasets: a HEAD to s3.amazonaws.com from load_dataset("json", ...)
}


def cache_dir() -> Path:
    """rlops' machine-wide cache (the default model, fingerprints, the empty MLflow database): `RLOPS_CACHE`,
    default `~/.cache/rlops`."""
    return Path(os.environ.get("RLOPS_CACHE", Path.home() / ".cache" / "rlops")).expanduser()


CACHE_VAR = "$RLOPS_CACHE"


def expand_cache(name_or_path: str) -> str:
    """A leading `$RLOPS_CACHE` -> rlops' cache folder (`cache_dir`, `~/.cache/rlops` when the variable is unset),
    so a config can name a model a `make` target built there wherever the cache is."""
    if name_or_path == CACHE_VAR or name_or_path.startswith(CACHE_VAR + "/"):
        return str(cache_dir()) + name_or_path[len(CACHE_VAR):]
    return name_or_path


def no_telemetry() -> None:
    """Switch the libraries' usage reports off (NO_TELEMETRY), before they are imported: each reads its
    switch once, at import or at start-up. Called where rlops first uses each of them."""
    for key, value in NO_TELEMETRY.items():
        os.environ.setdefault(key, value)


@dataclass(frozen=True)
class Settings:
    workspace: Path  # local folder: catalog, checkpoints, caches, Prefect home (always local)
    data_root: str  # Parquet root: a local folder or a pyarrow filesystem URI
    mlflow_uri: str  # MLflow tracking URI; SQLite in the workspace by default
    mlflow_artifacts: str  # where MLflow stores artifacts (models, reports)
    experiment: str = "rlops"  # MLflow experiment name

    @classmethod
    def from_env(cls, workspace: str | Path | None = None, **overrides: str) -> "Settings":
        """Settings from (in order) arguments, `RLOPS_*` environment variables, defaults.

        `RLOPS_WORKSPACE`, `RLOPS_DATA_ROOT`, `RLOPS_MLFLOW_URI` (or `MLFLOW_TRACKING_URI`),
        `RLOPS_MLFLOW_ARTIFACTS`, `RLOPS_EXPERIMENT`.
        """
        ws = Path(workspace or os.environ.get("RLOPS_WORKSPACE") or DEFAULT_WORKSPACE).expanduser().resolve()
        settings = cls(
            workspace=ws,
            data_root=os.environ.get("RLOPS_DATA_ROOT") or str(ws / "data"),
            mlflow_uri=os.environ.get("RLOPS_MLFLOW_URI")
            or os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{ws / 'mlflow.db'}",
            mlflow_artifacts=os.environ.get("RLOPS_MLFLOW_ARTIFACTS") or str(ws / "mlartifacts"),
            experiment=os.environ.get("RLOPS_EXPERIMENT") or "rlops",
        )
        return replace(settings, **overrides) if overrides else settings

    @property
    def catalog_path(self) -> Path:
        return self.workspace / "catalog.duckdb"

    @property
    def snapshot_dir(self) -> Path:
        """Parquet copies of the catalog tables, refreshed on every catalog write, so readers
        (`rlops sql`) never need the DuckDB file that the pipeline holds open for writing."""
        return self.workspace / "catalog"

    @property
    def checkpoints_dir(self) -> Path:
        return self.workspace / "checkpoints"

    @property
    def images_dir(self) -> Path:
        """The content-addressed image store (storage/images.py)."""
        return self.workspace / "images"

    @property
    def prefect_home(self) -> Path:
        return self.workspace / "prefect"

    @property
    def cache_dir(self) -> Path:
        """Workspace-local caches (judge responses)."""
        return self.workspace / "cache"
