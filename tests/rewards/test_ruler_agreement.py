"""The judge-agreement query of docs/REWARDS.md on a workspace with hand-picked values (DuckDB, no model)."""

from __future__ import annotations

import math
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from rewards.agreement import AGREEMENT_SQL
from storage.schema import RewardRow, to_table
from storage.sql import Sandbox
from storage.workspace import Workspace
from tests.factories import tool_episode

BATCH = "ro-agree"
# group -> (correct, ruler) per rollout; None: the judge's row is an error
GROUPS = {
    0: ([1.0, 0.0, 0.0, 1.0], [0.9, 0.2, 0.9, 0.5]),  # pairs (0,1) agree, (0,2) judge tie, (1,3) agree, (2,3) disagree
    1: ([0.0, 1.0, 0.0], [None, None, None]),  # the judge failed on the group: 2 unjudged pairs
    2: ([0.0, 0.0, 0.0], [0.1, 0.5, 0.7]),  # nothing for the judge to agree with: no pairs
}
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _rows(rollouts, name: str, version: str, values, scored_at: datetime) -> list[RewardRow]:
    return [RewardRow(r.rollout_id, BATCH, name, version, v, {}, None if v is not None else "JudgeError: no JSON",
                      f"rw-{name}-{version}", scored_at) for r, v in zip(rollouts, values)]


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    ws = Workspace.open(tmp_path / "ws")
    groups = {g: [tool_episode(BATCH, g, s) for s in range(len(correct))] for g, (correct, _) in GROUPS.items()}
    ws.write_part("rollouts", BATCH, to_table([r for rs in groups.values() for r in rs]), part="part-0")
    ws.catalog.complete_artifact(BATCH, "rollouts", "rollout", [], "cfg")
    rows = []
    for g, (correct, ruler) in GROUPS.items():
        rows += _rows(groups[g], "correct", "c1", correct, T0)
        rows += _rows(groups[g], "ruler", "j2", ruler, T0 + timedelta(hours=1))
        # An older judge version that ordered group 0 the other way round: the newest score wins.
        rows += _rows(groups[g], "ruler", "j1", [1 - v if v is not None else 0.5 for v in ruler], T0)
        rows += _rows(groups[g], "style", "s1", [0.0] * len(correct), T0)  # another reward: ignored
    for name, version in {(r.reward_name, r.reward_version) for r in rows}:
        part = [r for r in rows if (r.reward_name, r.reward_version) == (name, version)]
        ws.write_part("rewards", f"rw-{name}-{version}", to_table(part), part="part-0")
        ws.catalog.complete_artifact(f"rw-{name}-{version}", "rewards", "score", [BATCH], "cfg")
    return ws


def test_agreement_query_counts_pairs_ties_and_spearman(ws: Workspace) -> None:
    (got,) = ws.query(AGREEMENT_SQL).to_pylist()
    assert {k: got[k] for k in ("pairs", "unjudged", "concordant", "discordant", "judge_ties")} == {
        "pairs": 6, "unjudged": 2, "concordant": 2, "discordant": 1, "judge_ties": 1}
    assert got["agreement"] == pytest.approx(2 / 3, abs=1e-4)
    assert got["agreement_ties_half"] == pytest.approx(2.5 / 4, abs=1e-4)
    # Group 0 only (group 1 has no judge values, group 2 no variation in `correct`). Average ranks:
    # judge [0.9, 0.2, 0.9, 0.5] -> [3.5, 1, 3.5, 2]; correct [1, 0, 0, 1] -> [3.5, 1.5, 1.5, 3.5];
    # deviations [1, -1.5, 1, -0.5] and [1, -1, -1, 1]: rho = 1 / sqrt(4.5 * 4).
    assert got["rho_groups"] == 1
    assert got["mean_spearman"] == pytest.approx(1 / math.sqrt(18), abs=1e-4)


def test_the_query_runs_in_the_rlops_sql_sandbox(ws: Workspace) -> None:
    sandbox = Sandbox(ws.settings)
    try:
        (got,) = sandbox.query(AGREEMENT_SQL).to_pylist()
    finally:
        sandbox.con.close()
    assert got == ws.query(AGREEMENT_SQL).to_pylist()[0]


def test_the_docs_show_this_exact_query() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "REWARDS.md").read_text()
    section = doc.split("### Agreement with a programmatic reward", 1)[1]
    shown = re.search(r"```sql\n(.*?)```", section, re.S).group(1)
    assert shown == AGREEMENT_SQL
