"""Config files: YAML, `--set dotted.key=value` overrides, and validation before any compute.

    cfg = load_config("configs/arithmetic.yaml", ["grpo.lr=5e-5", "rollout.group_size=4"])

Override values are parsed as YAML scalars (`5e-5` -> float, `true` -> bool, `[a, b]` -> list).
Validation collects every problem (unknown keys, wrong types, missing files) into one
`ConfigError` whose message lists them all, so a user fixes a config in one pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A config that cannot be used; the message lists every problem found."""


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set `a.b.c=value` items in a nested dict (creating intermediate dicts)."""
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"--set {item!r}: expected dotted.key=value")
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            problems.append(f"--set {item!r}: value is not valid YAML ({e.__class__.__name__})")
            continue
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                problems.append(f"--set {item!r}: {part!r} is not a section")
                break
            node = child
        else:
            node[parts[-1]] = value
    if problems:
        raise ConfigError("invalid overrides:\n  - " + "\n  - ".join(problems))
    return data


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def validate(model: type[M], data: dict[str, Any], source: str = "config") -> M:
    """Validate `data` against a pydantic model, turning every error into one readable message."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            where = ".".join(str(x) for x in err["loc"]) or "(top level)"
            msg = "unknown key (not allowed)" if err["type"] == "extra_forbidden" else err["msg"]
            given = "" if err["type"] in ("missing", "extra_forbidden") else f" (got {err.get('input')!r:.60})"
            lines.append(f"{where}: {msg}{given}")
        raise ConfigError(f"{source} is invalid ({len(lines)} problem{'s' if len(lines) > 1 else ''}):\n  - "
                          + "\n  - ".join(lines)) from None


def load_config(model: type[M], path: str | Path, overrides: list[str] | None = None) -> M:
    """Read a YAML config, apply overrides, validate."""
    data = apply_overrides(read_yaml(path), overrides or [])
    return validate(model, data, source=str(path))
