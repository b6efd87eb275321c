"""MLflow's model registry: a registered model per served line of checkpoints, a version per checkpoint, aliases.

    registry = Registry(ws.tracker.client)               # the driver (runs, `rlops promote`): reads and writes
    registry = Registry.reader(settings)                 # a server (`rlops serve`): reads only; None without MLflow
    version = registry.register("nightly", policy_id="ck-...", source=uri, run_id=run, model_id=m, tags={...})
    registry.set_alias("nightly", "champion", version)
    registry.get("nightly", alias="champion")           # -> Version (KeyError when there is none)
    ModelRef.parse("models:/nightly@champion")          # or "nightly@champion", "models:/nightly/3"

A version carries its checkpoint's policy id as the tag `rlops.policy_id` (and its lineage as other `rlops.*`
tags); the catalog maps that id to the adapter folder. Registering is idempotent per (model, policy id): a
resumed run finds its version instead of adding a second one. mlflow is imported inside the functions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from storage.settings import Settings

POLICY_TAG = "rlops.policy_id"
# A registered model's name as rlops writes it: it goes into MLflow filter strings, which take no parameters.
NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"
# `RUN@latest` is the run's newest checkpoint (stages/policy_ref.py); MLflow reserves the alias `latest` too.
LATEST = "latest"


@dataclass(frozen=True)
class ModelRef:
    """A registered model and one of its aliases or version numbers."""

    name: str
    alias: str | None = None
    version: str | None = None

    @classmethod
    def parse(cls, text: str) -> ModelRef | None:
        """`models:/NAME@ALIAS`, `models:/NAME/VERSION` or `NAME@ALIAS` (not `@latest`: a run's newest
        checkpoint); None for anything else (a checkpoint id, `base`, `RUN@latest`)."""
        body = text.removeprefix("models:/")
        uri = body != text
        if uri and (m := re.fullmatch(r"([A-Za-z0-9_.-]+)/(\d+)", body)):
            return cls(m.group(1), version=m.group(2))
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)@([A-Za-z0-9_-]+)", body)
        if m is not None and (uri or m.group(2) != LATEST):
            return cls(m.group(1), alias=m.group(2))
        if uri:
            raise KeyError(f"{text!r} is not a model URI rlops serves: models:/NAME@ALIAS or models:/NAME/VERSION")
        return None

    def __str__(self) -> str:
        return f"{self.name}@{self.alias}" if self.alias else f"models:/{self.name}/{self.version}"


@dataclass(frozen=True)
class Version:
    """One registered version: its number, the checkpoint it holds and its tags."""

    name: str
    version: str
    policy_id: str
    tags: dict[str, str] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()


class Registry:
    """Typed access to the registered models of one MLflow tracking store."""

    def __init__(self, client: Any) -> None:
        self.client = client  # an MlflowClient

    @classmethod
    def reader(cls, settings: Settings) -> Registry | None:
        """A registry to read from, or None when the workspace has no MLflow database yet (nothing is registered,
        and opening one would create it)."""
        database = settings.mlflow_uri.removeprefix("sqlite:///")
        if database != settings.mlflow_uri and not Path(database).exists():
            return None
        from mlflow.tracking import MlflowClient

        return cls(MlflowClient(tracking_uri=settings.mlflow_uri))

    def exists(self, name: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(name)
        except MlflowException:
            return False
        return True

    def register(self, name: str, *, policy_id: str, source: str, run_id: str | None, model_id: str | None,
                 tags: dict[str, str]) -> str:
        """The version of `name` holding `policy_id`: the existing one, else a new one (the registered model
        is created with the first version). `source` is where its files are (the logged model's artifacts)."""
        found = self.version_of(name, policy_id)
        if found is not None:
            return found
        if not self.exists(name):
            self.client.create_registered_model(name, tags={"rlops.kind": "policy"})
        made = self.client.create_model_version(name, source=source, run_id=run_id, model_id=model_id,
                                                tags={**tags, POLICY_TAG: policy_id})
        return str(made.version)

    def version_of(self, name: str, policy_id: str) -> str | None:
        """The version number of `name` that holds `policy_id`, or None."""
        _check(name, policy_id)
        found = self.client.search_model_versions(f"name = '{name}' AND tags.`{POLICY_TAG}` = '{policy_id}'")
        return str(min(int(v.version) for v in found)) if found else None

    def get(self, name: str, alias: str | None = None, version: str | None = None) -> Version:
        """The version an alias names, or a version by number; KeyError saying what is missing."""
        from mlflow.exceptions import MlflowException

        try:
            found = (self.client.get_model_version_by_alias(name, alias) if alias is not None
                     else self.client.get_model_version(name, version))
        except MlflowException as e:
            if not self.exists(name):
                raise KeyError(f"no registered model {name!r} in this workspace's MLflow (a run with a `promote:` "
                               "section, or a scheduled run, registers its final checkpoint)") from None
            what = f"alias {alias!r}" if alias is not None else f"version {version}"
            raise KeyError(f"registered model {name!r} has no {what} ({e.message})") from None
        policy = found.tags.get(POLICY_TAG)
        if policy is None:
            raise KeyError(f"version {found.version} of {name!r} was not registered by rlops (no {POLICY_TAG} tag)")
        return Version(name, str(found.version), policy, dict(found.tags), tuple(found.aliases or ()))

    def resolve(self, ref: ModelRef) -> Version:
        return self.get(ref.name, alias=ref.alias, version=ref.version)

    def set_alias(self, name: str, alias: str, version: str) -> None:
        self.client.set_registered_model_alias(name, alias, version)

    def aliases(self) -> list[tuple[str, str, str]]:
        """(registered model, alias, version) of every alias of every registered model."""
        return [(m.name, alias, str(version)) for m in self.client.search_registered_models(max_results=1000)
                for alias, version in sorted((m.aliases or {}).items())]


def _check(name: str, policy_id: str) -> None:
    """Both go into an MLflow filter string (no parameters there): only names and ids of rlops' own shape."""
    if not re.fullmatch(NAME_PATTERN, name) or not re.fullmatch(r"[A-Za-z0-9_-]+", policy_id):
        raise ValueError(f"not a registered model name and policy id: {name!r}, {policy_id!r}")
