"""Which policy a request's `model` names: a checkpoint id, `base`, `RUN@latest` or a registered model's alias
(`NAME@champion`, `models:/NAME@champion`) from a workspace (`rlops serve`), or the one policy of a rollout (an
external agent's shard).

A resolver maps a model name to (policy id, adapter folder or None for the base) and raises KeyError
for an unknown name; it comes with a function listing the models it serves (`GET /v1/models`): names, or
entries `{"id": name, ...}` saying more (an alias's version and policy).

`EpisodePins` keeps an episode on the policy its first call resolved: a moved alias is followed between
requests, never in the middle of an episode.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

from stages.policy_ref import checkpoint_rows, find_checkpoint
from storage.registry import ModelRef, Registry

# A model name -> (policy id, adapter folder or None for the base). Raises KeyError when unknown.
Resolver = Callable[[str], tuple[str, str | None]]
# What GET /v1/models lists: model names, or entries {"id": name, ...} with more about one.
Names = Callable[[], list[str | dict[str, Any]]]


def catalog_resolver(checkpoints_file: Path, base_model: str, registry: Registry | None = None,
                     announce: Callable[[str], None] = lambda line: None) -> tuple[Resolver, Names]:
    """Resolve `model` names against a workspace's checkpoints: a policy id, `base`, `RUN@latest`, or (with a
    `registry`) a registered model's alias or version. Only checkpoints of `base_model` can be served. Read on
    every request, so checkpoints written and aliases moved after the server started are served without a
    restart; `announce` gets a line whenever an alias is first served and whenever it names another version."""
    served: dict[str, str] = {}  # alias -> the version it last resolved to
    lock = threading.Lock()

    def resolve(name: str) -> tuple[str, str | None]:
        if name == "base":
            return "base", None
        row = find_checkpoint(checkpoints_file, name, registry)
        if row["base_model"] != base_model:
            raise KeyError(f"{row['policy_id']} is trained on {row['base_model']!r}; this server serves {base_model!r}")
        if row["adapter_uri"] and not Path(row["adapter_uri"]).exists():
            raise KeyError(f"the adapter files of {row['policy_id']} are missing: {row['adapter_uri']}")
        if "registered" in row:
            _announce_change(name, row["registered"].version, row["policy_id"])
        return row["policy_id"], row["adapter_uri"]

    def _announce_change(name: str, version: str, policy_id: str) -> None:
        with lock:
            before = served.get(name)
            served[name] = version
        if before != version:
            was = f" (was version {before})" if before else ""
            announce(f"{name} serves version {version}, policy {policy_id}{was}")

    def names() -> list[str | dict[str, Any]]:
        table = [r for r in checkpoint_rows(checkpoints_file) if r["kind"] != "base" and r["base_model"] == base_model]
        runs = sorted({r["run_name"] for r in table if r["run_name"]})
        ours = {r["policy_id"] for r in table}
        aliases: list[str | dict[str, Any]] = []
        for model, alias, version in registry.aliases() if registry is not None else []:
            policy = registry.get(model, version=version).policy_id
            if policy in ours:
                aliases.append({"id": f"{model}@{alias}", "version": version, "policy_id": policy})
        return ["base"] + [r["policy_id"] for r in table] + [f"{run}@latest" for run in runs] + aliases

    return resolve, names


class EpisodePins:
    """`resolve` with memory per episode: the first call of an episode that names a moving reference (an
    alias, `RUN@latest`) fixes the policy for the episode's later calls, so an alias moved mid-episode
    changes the next episode, never the rest of this one. Calls without an episode resolve afresh. The
    newest `keep` episodes are remembered."""

    def __init__(self, resolve: Resolver, keep: int = 10_000) -> None:
        self.resolve, self.keep = resolve, keep
        self._pins: OrderedDict[tuple[str, str], tuple[str, str | None]] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, model: str, episode: str | None) -> tuple[str, str | None]:
        if episode is None or not (model.endswith("@latest") or ModelRef.parse(model) is not None):
            return self.resolve(model)
        key = (episode, model)
        with self._lock:
            pinned = self._pins.get(key)
        if pinned is None:
            pinned = self.resolve(model)
        with self._lock:
            self._pins[key] = pinned
            self._pins.move_to_end(key)
            while len(self._pins) > self.keep:
                self._pins.popitem(last=False)
        return pinned


def fixed_resolver(policy_id: str, adapter_dir: str | None) -> tuple[Resolver, Names]:
    """Serve exactly one policy (the rollout stage's), named by its id."""

    def resolve(name: str) -> tuple[str, str | None]:
        if name != policy_id:
            raise KeyError(f"unknown model {name!r}: this rollout serves {policy_id!r} (the `model` argument)")
        return policy_id, adapter_dir

    return resolve, lambda: [policy_id]
