"""Judge drift (rewards/drift.py): the measures on hand-made groups, and the score stage recording them (its metrics,
the reward set's meta, the `judge_drift` view) with a real judge endpoint on 127.0.0.1."""

from __future__ import annotations

import json
import math
import re

import pytest

from rewards.base import RewardSpec
from rewards.drift import drift, drift_counts, measures
from stages import score
from stages.common import StageContext
from storage.schema import to_table
from tests.factories import tool_episode
from tests.rewards.conftest import chat_reply, judge_server  # noqa: F401 - the judge_server fixture
from tests.storage.conftest import ws  # noqa: F401 - the ws fixture

# (answers of a group's four episodes): the truth is "1987" (exact_match); the judge below scores by answer
GROUPS = [
    ["1987", "1988", "1988", "2000"],  # judge: 0.9, 0.1, 0.1, 0.9 -> 2 concordant pairs, 1 tied (1987 vs 2000)
    ["1987", "1987", "1999", "1999"],  # judge: 0.9, 0.9, 1.0, 1.0 -> 4 discordant pairs (it prefers the wrong 1999)
    ["1990", "1990", "1990", "1990"],  # judge: 0.5 x 4 -> no order at all (degenerate); the truth orders no pair
]
JUDGED = {"1987": 0.9, "1988": 0.1, "2000": 0.9, "1999": 1.0, "1990": 0.5}


def test_measures_on_hand_made_groups() -> None:
    judge = [JUDGED[a] for g in GROUPS for a in g]
    truth = [float(a == "1987") for g in GROUPS for a in g]
    groups = [f"g{i}" for i, g in enumerate(GROUPS) for _ in g]
    assert drift_counts(judge, truth, groups) == {"concordant": 2, "discordant": 4, "tied": 1, "pairs": 7, "groups": 3,
                                                  "degenerate": 1}
    got = drift(judge, truth, groups)
    assert got["agreement"] == pytest.approx(2 / 6) and got["tied_pairs"] == pytest.approx(1 / 7)
    assert got["pairs"] == 7 and got["degenerate_groups"] == pytest.approx(1 / 3)

    # a judge error in a group: its pairs count as unjudged (in `pairs`, not ordered) and the group is degenerate
    judge[1] = None
    counts = drift_counts(judge, truth, groups)
    assert counts["pairs"] == 7 and counts["concordant"] == 1 and counts["degenerate"] == 1 + 1
    # groups of one (an evaluation batch's) have nothing to order: not counted, so nothing is undefined as degenerate
    single = drift_counts([0.3, 0.9], [1.0, 0.0], ["a", "b"])
    assert single["groups"] == 0 and single["pairs"] == 0 and math.isnan(measures(single)["degenerate_groups"])
    # nothing the truth orders: the ratios are undefined, not 0
    flat = drift([0.2, 0.8], [1.0, 1.0], ["g", "g"])
    assert math.isnan(flat["agreement"]) and math.isnan(flat["tied_pairs"]) and flat["degenerate_groups"] == 0.0
    with pytest.raises(ValueError, match="differ in length"):
        drift([0.1], [0.1, 0.2], ["g"])


def test_pooled_counts_are_the_counts_of_the_whole() -> None:
    judge = [JUDGED[a] for g in GROUPS for a in g]
    truth = [float(a == "1987") for g in GROUPS for a in g]
    groups = [f"g{i}" for i, g in enumerate(GROUPS) for _ in g]
    parts = [drift_counts(judge[:4], truth[:4], groups[:4]), drift_counts(judge[4:], truth[4:], groups[4:])]
    summed = {k: parts[0][k] + parts[1][k] for k in parts[0]}
    assert measures(summed) == drift(judge, truth, groups)


def _by_answer(body, headers):
    """A ranking judge scoring each trajectory by its final answer alone (JUDGED)."""
    text = body["messages"][1]["content"]
    blocks = re.findall(r'<trajectory id="([^"]+)">\n(.*?)\n</trajectory>', text, re.S)
    scores = [{"id": i, "score": JUDGED[json.loads(b)[-1]["content"]]} for i, b in blocks]
    return chat_reply(json.dumps({"scores": scores}))


def test_the_score_stage_records_the_judges_drift(ws, judge_server) -> None:  # noqa: F811
    judge_server.respond = _by_answer
    episodes = [tool_episode("ro-d", g, s, answer=a) for g, answers in enumerate(GROUPS) for s, a in enumerate(answers)]
    ws.write_part("rollouts", "ro-d", to_table(episodes), part="groups-00000")
    ws.catalog.complete_artifact("ro-d", "rollouts", "rollout", [], "cfg")
    config = score.ScoreConfig(rewards=[
        RewardSpec(name="judge", fn="rewards.ruler.ruler_reward", params={"model": "m", "base_url": judge_server.url}),
        RewardSpec(name="correct", fn="rewards.builtin.exact_match"),
    ])
    ref = score.run(config, StageContext(ws, run_name="drift"), ["ro-d"])

    meta = ws.catalog.get_artifact(ref.id)["meta"]
    (row,) = meta["drift"]
    assert row["judge"] == "judge" and row["truth"] == "correct" and row["pairs"] == 7
    assert row["agreement"] == pytest.approx(2 / 6) and row["tied_pairs"] == pytest.approx(1 / 7)
    assert row["degenerate_groups"] == pytest.approx(1 / 3)
    assert meta["metrics"]["judge.agreement.correct"] == pytest.approx(2 / 6)
    assert meta["metrics"]["judge.degenerate_groups"] == pytest.approx(1 / 3)

    (viewed,) = ws.query("SELECT * FROM judge_drift").to_pylist()
    assert viewed["run_name"] == "drift" and viewed["batches"] == ["ro-d"] and viewed["pairs"] == 7
    assert viewed["agreement"] == pytest.approx(2 / 6)

    (run_id,) = [r["mlflow_run_id"] for r in ws.query("SELECT artifact_id, mlflow_run_id FROM stage_runs").to_pylist()
                 if r["artifact_id"] == ref.id]
    logged = ws.tracker.client.get_run(run_id).data.metrics
    assert logged["judge.agreement.correct"] == pytest.approx(2 / 6)
    assert logged["judge.tied_pairs.correct"] == pytest.approx(1 / 7)

    # the same batch scored again with nothing new to compute: the reward set's drift is read from the stored rows
    again = score.run(config, StageContext(ws, run_name="drift", force=True), ["ro-d"])
    assert ws.catalog.get_artifact(again.id)["meta"]["drift"][0]["pairs"] == 7
