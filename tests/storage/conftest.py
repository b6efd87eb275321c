from __future__ import annotations

import pytest

from storage.schema import to_table
from storage.workspace import Workspace
from tests.factories import reward_rows, tool_episode


def add_batch(ws: Workspace, batch_id: str, groups: int = 2, size: int = 4, reward_version: str | None = "v1") -> list:
    """Write and register a complete rollout batch (and a reward batch unless reward_version is None)."""
    rollouts = [tool_episode(batch_id, g, s, answer="1987" if s % 2 else "no idea") for g in range(groups) for s in range(size)]
    for g in range(groups):
        part = [r for r in rollouts if r.group_id.endswith(f"g{g}")]
        ws.write_part("rollouts", batch_id, to_table(part), part=f"group-{g:05d}")
    ws.catalog.complete_artifact(batch_id, "rollouts", "rollout", [], "cfg")
    if reward_version is None:
        return rollouts
    score_id = f"rw-{batch_id}-{reward_version}"
    ws.write_part("rewards", score_id, to_table(reward_rows(rollouts, "correct", reward_version, score_id)), part="part-0")
    ws.catalog.complete_artifact(score_id, "rewards", "score", [batch_id], "cfg")
    return rollouts


@pytest.fixture
def ws(tmp_path) -> Workspace:
    return Workspace.open(tmp_path / "ws")
