"""Which reward, which version: the one home for that decision.

    ref = RewardRef.parse("correct@1a2b3c4d5e6f")      # or "correct": the version is resolved later
    ref = RewardRef.configured(score_config, "correct")  # the version the config's code and params give now
    ref = ref.resolve(ws, batches)                     # no version: the newest scored on all of `batches`
    str(ref)                                           # "correct@1a2b3c4d5e6f": what checkpoints record

The name trained on or evaluated when none is named is `ScoreConfig.default_reward` (the weighted
total, else the first reward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stages.score import ScoreConfig
    from storage.workspace import Workspace


@dataclass(frozen=True)
class RewardRef:
    """A reward name and, once known, one of its versions."""

    name: str
    version: str | None = None

    @classmethod
    def parse(cls, text: str) -> RewardRef:
        """`name` or `name@version` (as printed by `rlops rewards ls` and stored in `trained_on`)."""
        name, sep, version = text.strip().partition("@")
        if not name or (sep and not version) or "@" in version:
            raise ValueError(f"a reward is NAME or NAME@VERSION, got {text!r}")
        return cls(name, version or None)

    @classmethod
    def configured(cls, config: ScoreConfig, name: str) -> RewardRef:
        """`name` at the version its current code and params have in `config` (what the score stage writes)."""
        from stages.score import versions

        known = versions(config)
        if name not in known:
            raise KeyError(f"reward {name!r} is not one of the score rewards {sorted(known)}")
        return cls(name, known[name])

    def resolve(self, ws: Workspace, batches: list[str]) -> RewardRef:
        """This reference with a version: its own, or the newest version of the reward scored on every
        one of `batches` (KeyError when there is none: run the score stage first)."""
        if self.version:
            return self
        rows = ws.query(
            "SELECT reward_version FROM rewards WHERE reward_name = $name AND list_contains($batches, batch_id) "
            "GROUP BY reward_version HAVING count(DISTINCT batch_id) = $n ORDER BY max(scored_at) DESC LIMIT 1",
            {"name": self.name, "batches": sorted(set(batches)), "n": len(set(batches))}).to_pylist()
        if not rows:
            raise KeyError(f"reward {self.name!r} has no version scored on all of {sorted(set(batches))}: "
                           "run the score stage first")
        return RewardRef(self.name, rows[0]["reward_version"])

    def __str__(self) -> str:
        return f"{self.name}@{self.version}" if self.version else self.name
