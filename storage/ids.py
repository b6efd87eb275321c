"""Deterministic artifact ids.

An artifact's id is a hash of what produced it: the stage, its input artifact ids, its
config and the code/reward version. Running a stage twice on the same inputs yields the
same id, so the catalog can answer "already done" without any orchestrator state.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

# Short, readable prefixes so an id says what it is in SQL output and logs.
PREFIX = {"rollout": "ro", "score": "rw", "reward_set": "rs", "grpo": "ck", "sft": "ck", "dpo": "ck", "ppo": "ck", "evaluate": "ev", "base": "base"}


def canonical_json(value: Any, strict: bool = False) -> str:
    """JSON with sorted keys and no whitespace: equal values give equal text (and hashes).

    strict: only JSON values (a TypeError for anything else, a ValueError for NaN/inf), for text that
    is stored and read back (reward details) or must not hash two values alike (reward versions);
    otherwise other values are written as their str() (ids of configs holding paths)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=not strict,
                      default=None if strict else str, ensure_ascii=False)


def config_hash(config: Any) -> str:
    return hashlib.sha256(canonical_json(config).encode()).hexdigest()[:16]


def artifact_id(stage: str, inputs: list[str], config: Any, version: str = "") -> str:
    """`<prefix>-<16 hex>` from (stage, input ids in order, config, version)."""
    payload = canonical_json({"stage": stage, "inputs": list(inputs), "config": config, "version": version})
    return f"{PREFIX.get(stage, stage)}-{hashlib.sha256(payload.encode()).hexdigest()[:16]}"
