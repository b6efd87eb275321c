"""The `human` reward: labelled episodes take their label, and its version follows the labels, so a rescore after
new labels computes a new version and a rescore without new labels computes nothing."""

from __future__ import annotations

import pytest

from rewards.base import RewardSpec, compute
from stages import score
from stages.common import StageContext
from stages.reward_ref import RewardRef
from storage.labels import EpisodeKey, append_labels, grade, ordering
from storage.workspace import Workspace
from tests.factories import tool_episode
from tests.storage.conftest import add_batch

HUMAN = "rewards.human.human"
LABELS = {"r0": {"alice": 1.0, "bob": 0.5}, "r1": {"bob": 0.0}}


@pytest.mark.parametrize("params, expected", [
    ({}, [0.75, 0.0, None]),  # every reviewer, averaged; r2 was never labelled
    ({"reviewers": ["alice"]}, [1.0, None, None]),
    ({"reviewers": ["carol"]}, [None, None, None]),
])
def test_a_labelled_episode_takes_its_label(params: dict, expected: list[float | None]) -> None:
    rollouts = [tool_episode("ro", 0, s) for s in range(3)]
    for i, r in enumerate(rollouts):
        r.rollout_id = f"r{i}"
    outcomes = compute(RewardSpec(name="human", fn=HUMAN, params={"labels": LABELS, **params}), rollouts)
    assert [o.value for o in outcomes] == expected
    assert all(o.error.startswith("LookupError: not labelled") for o in outcomes if o.value is None)
    assert outcomes[0].details == ({"reviewers": {"alice": 1.0, "bob": 0.5}} if not params else
                                   {"reviewers": {"alice": 1.0}} if params["reviewers"] == ["alice"] else None)


def _values(ws: Workspace, version: str) -> dict[str, float | None]:
    rows = ws.query("SELECT rollout_id, value FROM rewards WHERE reward_name = 'human' AND reward_version = ?",
                    [version]).to_pylist()
    return {r["rollout_id"]: r["value"] for r in rows}


def test_rescoring_follows_the_labels(tmp_path) -> None:
    ws = Workspace.open(tmp_path / "ws")
    add_batch(ws, "ro-h", groups=2, size=4, reward_version=None)
    ctx = StageContext(ws, run_name="h")
    config = score.ScoreConfig(rewards=[RewardSpec(name="correct", fn="rewards.builtin.exact_match"),
                                        RewardSpec(name="human", fn=HUMAN)])
    key = [EpisodeKey(f"ro-h-g{g}-s{s}", "ro-h", f"ro-h-g{g}") for g in range(2) for s in range(4)]
    append_labels(ws, grade(ws.workspace_id, "alice", key[0], 1.0))
    append_labels(ws, ordering(ws.workspace_id, "alice", [key[6], key[4], key[5]]))

    first = score.run(config, ctx, ["ro-h"])  # 4 of 8 episodes labelled: the other nulls are not a failure
    v1 = ws.catalog.get_artifact(first.id)["meta"]["rewards"]["human"]
    assert RewardRef.configured(score.in_workspace(config, ws), "human").version == v1  # what a pipeline trains on
    assert _values(ws, v1) == {"ro-h-g0-s0": 1.0, "ro-h-g0-s1": None, "ro-h-g0-s2": None, "ro-h-g0-s3": None,
                               "ro-h-g1-s0": 0.5, "ro-h-g1-s1": 0.0, "ro-h-g1-s2": 1.0, "ro-h-g1-s3": None}
    totals = ws.query("SELECT rollout_id, value, error FROM rewards WHERE reward_name = 'total'").to_pylist()
    assert {t["rollout_id"] for t in totals if t["value"] is None} == {"ro-h-g0-s1", "ro-h-g0-s2", "ro-h-g0-s3",
                                                                       "ro-h-g1-s3"}

    parts = len(ws.catalog.artifacts("rewards"))
    assert score.run(config, ctx, ["ro-h"]).cached  # the same labels: the stored version, nothing computed
    assert len(ws.catalog.artifacts("rewards")) == parts

    append_labels(ws, grade(ws.workspace_id, "bob", key[0], 0.0))  # a new label: a new version of human
    second = score.run(config, ctx, ["ro-h"])
    v2 = ws.catalog.get_artifact(second.id)["meta"]["rewards"]
    assert v2["human"] != v1 and v2["correct"] == ws.catalog.get_artifact(first.id)["meta"]["rewards"]["correct"]
    assert len(ws.catalog.artifacts("rewards")) == parts + 2  # human and the total; correct was found stored
    assert _values(ws, v2["human"])["ro-h-g0-s0"] == 0.5 and _values(ws, v1)["ro-h-g0-s0"] == 1.0  # both kept
