"""People's labels: append-only rows, the SQL views over them (current labels, values, preferences, agreement with
hand-computed numbers), and writers in several processes at once, a pipeline among them, losing nothing."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest

from storage.labels import EpisodeKey, LabelError, append_labels, grade, label_values, ordering
from storage.schema import RewardRow, to_table
from storage.workspace import Workspace
from tests.storage.conftest import add_batch


def key(ws: Workspace, rollout_id: str) -> EpisodeKey:
    row = ws.query("SELECT batch_id, group_id FROM rollouts WHERE rollout_id = ?", [rollout_id]).to_pylist()[0]
    return EpisodeKey(rollout_id, row["batch_id"], row["group_id"])


def rows(ws: Workspace, sql: str, params: list | None = None) -> list[dict]:
    return ws.query(sql, params).to_pylist()


def test_labels_are_appended_and_a_later_label_supersedes_without_overwriting(ws: Workspace) -> None:
    add_batch(ws, "ro-a", groups=2, size=4, reward_version=None)
    wid = ws.workspace_id
    first = append_labels(ws, grade(wid, "alice", key(ws, "ro-a-g0-s0"), 1.0, note="right answer"))
    append_labels(ws, grade(wid, "bob", key(ws, "ro-a-g0-s0"), 0.0))
    again = append_labels(ws, grade(wid, "alice", key(ws, "ro-a-g0-s0"), 0.25))  # alice changes her mind
    got = rows(ws, "SELECT submission_id, reviewer, value, note, current FROM labels ORDER BY created_at")
    assert [(r["reviewer"], r["value"], r["current"]) for r in got] == [("alice", 1.0, False), ("bob", 0.0, True),
                                                                         ("alice", 0.25, True)]
    assert got[0]["submission_id"] == first and got[0]["note"] == "right answer" and got[2]["submission_id"] == again
    assert {a["artifact_id"] for a in ws.catalog.artifacts("labels")} == {r["submission_id"] for r in got}

    # An ordering of group 1, then a new one of the same group: the first is kept, no longer current.
    g1 = [key(ws, f"ro-a-g1-s{i}") for i in range(4)]
    append_labels(ws, ordering(wid, "alice", [g1[2], g1[0], g1[3]]))
    append_labels(ws, ordering(wid, "alice", [g1[3], g1[2], g1[1], g1[0]], note="tool use first"))
    order = rows(ws, "SELECT rollout_id, rank, ranked, value, current FROM labels WHERE kind = 'order' ORDER BY created_at, rank")
    assert [(r["rollout_id"][-2:], r["rank"], r["current"]) for r in order] == [
        ("s2", 1, False), ("s0", 2, False), ("s3", 3, False), ("s3", 1, True), ("s2", 2, True), ("s1", 3, True), ("s0", 4, True)]
    assert [r["value"] for r in order[3:]] == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0])
    assert {r["ranked"] for r in order} == {3, 4}


def test_values_and_preferences_come_from_the_current_labels(ws: Workspace) -> None:
    add_batch(ws, "ro-v", groups=1, size=3, reward_version=None)
    wid, k = ws.workspace_id, [key(ws, f"ro-v-g0-s{i}") for i in range(3)]
    append_labels(ws, grade(wid, "alice", k[0], 1.0))
    append_labels(ws, grade(wid, "alice", k[1], 0.0))
    append_labels(ws, grade(wid, "bob", k[0], 0.5))
    append_labels(ws, grade(wid, "bob", k[2], 0.5))  # a tie: no preference between them
    assert label_values(ws) == {"ro-v-g0-s0": {"alice": 1.0, "bob": 0.5}, "ro-v-g0-s1": {"alice": 0.0},
                                "ro-v-g0-s2": {"bob": 0.5}}
    pairs = rows(ws, "SELECT reviewer, preferred, other FROM label_pairs ORDER BY reviewer")
    assert [(p["reviewer"], p["preferred"][-2:], p["other"][-2:]) for p in pairs] == [("alice", "s0", "s1")]

    # Bob orders the group: his ordering decides his values there, his grades stay in the table.
    append_labels(ws, ordering(wid, "bob", [k[2], k[1], k[0]]))
    assert label_values(ws)["ro-v-g0-s0"] == {"alice": 1.0, "bob": 0.0}
    assert rows(ws, "SELECT count(*) AS n FROM labels WHERE reviewer = 'bob' AND kind = 'grade' AND current")[0]["n"] == 2
    bob = {(p["preferred"][-2:], p["other"][-2:]) for p in rows(ws, "SELECT * FROM label_pairs WHERE reviewer = 'bob'")}
    assert bob == {("s2", "s1"), ("s2", "s0"), ("s1", "s0")}


def _score(ws: Workspace, batch: str, name: str, values: dict[str, float | None]) -> None:
    sid = f"rw-{batch}-{name}"
    table = to_table([RewardRow(r, batch, name, "v1", v, {}, None if v is not None else "boom", sid) for r, v in values.items()])
    ws.write_part("rewards", sid, table, part="part-0")
    ws.catalog.complete_artifact(sid, "rewards", "score", [batch], "cfg")


def test_agreement_views_match_hand_computed_numbers(ws: Workspace) -> None:
    add_batch(ws, "ro-t", groups=2, size=4, reward_version=None)
    wid = ws.workspace_id
    g0 = [key(ws, f"ro-t-g0-s{i}") for i in range(4)]
    append_labels(ws, ordering(wid, "alice", g0))  # s0 > s1 > s2 > s3: 6 pairs
    for i, v in enumerate([1.0, 1.0, 0.0, 0.0]):  # group 1 graded: 4 pairs (s0, s1 over s2, s3)
        append_labels(ws, grade(wid, "alice", key(ws, f"ro-t-g1-s{i}"), v))
    ids = [f"ro-t-g{g}-s{i}" for g in range(2) for i in range(4)]
    # good: orders g0 with one tie (s1 = s2) and g1 right; bad: everything backwards, one episode unscored (an error)
    _score(ws, "ro-t", "good", dict(zip(ids, [1.0, 0.5, 0.5, 0.0, 0.9, 0.8, 0.1, 0.2])))
    _score(ws, "ro-t", "bad", dict(zip(ids, [0.0, 0.3, 0.6, 1.0, None, 0.0, 1.0, 1.0])))

    groups = {(r["reward_name"], r["group_id"][-2:]): r for r in rows(ws, "SELECT * FROM label_agreement_groups")}
    g = groups[("good", "g0")]
    assert (g["pairs"], g["concordant"], g["discordant"], g["ties"]) == (6, 5, 0, 1)
    assert g["kendall_tau"] == pytest.approx(5 / math.sqrt(6 * 5))  # tau-b with one tie on the reward's side
    assert groups[("bad", "g0")]["kendall_tau"] == pytest.approx(-1.0)
    assert groups[("good", "g1")]["kendall_tau"] is None  # grades: pairs, no ordering to correlate with
    assert (groups[("bad", "g1")]["pairs"], groups[("bad", "g1")]["discordant"]) == (2, 2)  # s0 unscored: 2 of 4 pairs

    overall = {r["reward_name"]: r for r in rows(ws, "SELECT * FROM label_agreement")}
    assert overall["good"]["pairs"] == 10 and overall["good"]["pairwise_accuracy"] == pytest.approx((9 + 0.5) / 10)
    assert overall["good"]["ranked_groups"] == 1 and overall["bad"]["pairwise_accuracy"] == 0.0
    assert overall["bad"]["groups"] == 2 and overall["bad"]["pairs"] == 8

    # A second reviewer agreeing on group 0 but for one swap: judged as a reward is, against alice's pairs.
    append_labels(ws, ordering(wid, "bob", [g0[1], g0[0], g0[2], g0[3]]))
    by = rows(ws, "SELECT * FROM reviewer_agreement_groups WHERE reviewer_a = 'alice'")
    assert [(r["reviewer_b"], r["pairs"], r["concordant"], r["discordant"]) for r in by] == [("bob", 6, 5, 1)]
    assert by[0]["kendall_tau"] == pytest.approx(4 / 6)


@pytest.mark.parametrize("make, message", [
    (lambda wid, k: grade(wid, "alice", k[0], 1.5), "value: a grade is a number in [0, 1]"),
    (lambda wid, k: grade(wid, "alice", k[0], float("nan")), "value: a grade is a number in [0, 1]"),
    (lambda wid, k: grade(wid, "alice", k[0], True), "value: a grade is a number in [0, 1]"),
    (lambda wid, k: grade(wid, "  ", k[0], 1.0), "reviewer: a name of 1 to 64"),
    (lambda wid, k: grade(wid, "alice", k[0], 1.0, note="x" * 2001), "note: at most 2000"),
    (lambda wid, k: ordering(wid, "alice", [k[0]]), "order: at least two distinct"),
    (lambda wid, k: ordering(wid, "alice", [k[0], k[0]]), "order: at least two distinct"),
    (lambda wid, k: ordering(wid, "alice", [k[0], k[4]]), "every episode must be of one group"),
])
def test_a_bad_label_is_refused_by_name(ws: Workspace, make, message: str) -> None:
    add_batch(ws, "ro-b", groups=2, size=4, reward_version=None)
    keys = [key(ws, f"ro-b-g{g}-s{i}") for g in range(2) for i in range(4)]
    with pytest.raises(LabelError, match=message.replace("[", r"\[").replace("]", r"\]")):
        make(ws.workspace_id, keys)
    assert rows(ws, "SELECT count(*) AS n FROM labels")[0]["n"] == 0


WRITER = """
import sys, time
from storage.labels import EpisodeKey, append_labels, grade
from storage.workspace import Workspace
ws = Workspace.open(sys.argv[1])
for i in range(int(sys.argv[3])):
    append_labels(ws, grade(ws.workspace_id, sys.argv[2], EpisodeKey(f"ro-c-g0-s{i % 4}", "ro-c", "ro-c-g0"), i / 100))
"""

HOLDER = """
import sys, time
from storage.workspace import Workspace
ws = Workspace.open(sys.argv[1])
with ws.catalog.connect():
    print("inside", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_writers_in_several_processes_and_a_pipeline_lose_nothing(ws: Workspace) -> None:
    """Two reviewers' processes append labels while this process writes the catalog as a pipeline's driver does:
    each catalog call waits its turn (storage/catalog.py), so every label is there and nobody failed."""
    add_batch(ws, "ro-c", groups=1, size=4, reward_version=None)
    n = 15
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(ws.root), who, str(n)], stderr=subprocess.PIPE, text=True)
               for who in ("alice", "bob")]
    for i in range(30):  # the "pipeline": stage runs recorded meanwhile
        ws.catalog.record_stage_run({"stage": "rollout", "artifact_id": f"ro-x{i}", "status": "complete"})
    for w in writers:
        assert w.wait(timeout=120) == 0, w.stderr.read()[-2000:]
    got = rows(ws, "SELECT reviewer, count(*) AS n, count(DISTINCT submission_id) AS s FROM labels GROUP BY 1 ORDER BY 1")
    assert got == [{"reviewer": "alice", "n": n, "s": n}, {"reviewer": "bob", "n": n, "s": n}]
    assert len(ws.catalog.stage_runs()) == 30

    # A process inside a catalog call for 1.5 s: a label sent meanwhile waits for it, then is written.
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(ws.root), "1.5"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "inside"
    start = time.monotonic()
    append_labels(ws, grade(ws.workspace_id, "carol", key(ws, "ro-c-g0-s0"), 1.0))
    assert time.monotonic() - start > 0.5 and holder.wait(timeout=60) == 0
    assert rows(ws, "SELECT count(*) AS n FROM labels WHERE reviewer = 'carol'")[0]["n"] == 1
