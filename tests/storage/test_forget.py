"""Forgetting a person (storage/forget.py, `rlops traffic forget`): their calls, feedback, the rollouts re-sampled from
their scenarios (rewards, labels, verdicts), traces and cached judge text are gone from every file of the workspace, the
others' are all kept, and the checkpoints trained on their scenarios are listed, in the output and in SQL."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flows.cli import main
from storage.forget import forget
from storage.labels import EpisodeKey, append_labels, grade
from storage.schema import SCHEMA_VERSION, TABLES, now, to_table
from storage.traces import search, trace_rollouts, trace_served
from storage.traffic import TrafficLog, TrafficSettings
from storage.workspace import Workspace
from tests.factories import reward_rows, served_call, tool_episode

SECRET = "Alice's question " + uuid.uuid4().hex  # what must be nowhere after
OTHER = "Bob's question " + uuid.uuid4().hex  # what must stay


def holds(path: Path, needle: str) -> bool:
    """Whether a file holds `needle`: its bytes, or for a Parquet file (compressed pages) every value it decodes to."""
    data = path.read_bytes()
    if needle.encode() in data:
        return True
    if path.suffix == ".parquet" and data[:4] == b"PAR1":
        return needle in json.dumps(pq.read_table(path).to_pylist(), default=str, ensure_ascii=False)
    return False


def holding(root: Path, needle: str) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and holds(p, needle))


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    """Alice asked twice in one session (and once more the same question, spaced differently), Bob once; a rollout
    batch re-sampled from all three scenarios was scored, labelled, judged, traced and trained on twice."""
    ws = Workspace.open(tmp_path / "ws")
    log = TrafficLog(ws, TrafficSettings(flush_calls=100, flush_seconds=3600))
    calls = [served_call(0, SECRET, user="alice", session="sa", episode="ea-1"),
             served_call(1, "  " + SECRET.upper(), user="carol", session="sc", episode="ec-1"),  # the same question
             served_call(2, "Another thing alice asked", user="alice", session="sa", episode="ea-2"),
             served_call(3, OTHER, user="bob", session="sb", episode="eb-1")]
    for c in calls:
        log.add(c)
    log.flush()
    log.feedback("ea-1", score=0.0, comment="wrong: " + SECRET)
    log.feedback("eb-1", score=1.0, comment="fine")
    log.close()

    batch = "ro-traffic"
    rollouts = []
    for g, c in enumerate(c for c in calls if c["user_id"] != "carol"):  # one group of two per scenario
        for s in range(2):
            r = tool_episode(batch, g, s)
            r.task, r.prompt_id, r.messages[1].content = "traffic", c["scenario_id"], c["messages"][1]["content"]
            rollouts.append(r)
    ws.write_part("rollouts", batch, to_table(rollouts), part="part-0")
    ws.catalog.complete_artifact(batch, "rollouts", "rollout", [], "cfg")
    ws.write_part("rewards", "rw-1", to_table(reward_rows(rollouts, "ruler", "v1", "rw-1")), part="part-0")
    ws.catalog.complete_artifact("rw-1", "rewards", "score", [batch], "cfg")
    append_labels(ws, grade(ws.workspace_id, "rev", EpisodeKey(rollouts[0].rollout_id, batch, rollouts[0].group_id), 1.0))
    verdicts = [{"comparison_id": "jv-1", "prompt_id": r.prompt_id, "champion": "base", "challenger": "ck-1",
                 "champion_rollout": "a", "challenger_rollout": "b", "p_challenger_first": 0.9,
                 "p_challenger_second": 0.8, "win": 0.85, "judge_model": "j", "judge_version": "v", "created_at": now(),
                 "schema_version": SCHEMA_VERSION} for r in rollouts[::2]]
    ws.write_artifacts("verdicts", "judge_gate", [("jv-1", pa.Table.from_pylist(verdicts, schema=TABLES["verdicts"]),
                                                   [batch], "cfg", {})])
    for pid, parent, trained in [("ck-1", "base", {"batches": [batch]}), ("ck-2", "ck-1", {"batches": ["ro-later"]})]:
        ws.catalog.add_checkpoint({"policy_id": pid, "parent_id": parent, "base_model": "m", "kind": "grpo",
                                   "adapter_uri": "/x", "step": int(pid[-1]), "trained_on": trained, "config_hash": "h",
                                   "run_name": "nightly"})
    cache = ws.judge_cache_dir / "ab" / "ab12.json"
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"reply": f"Trajectory 1 answers {SECRET!r} well"}))
    run = ws.tracker.start_run("night")
    trace_served(ws, ws.query("SELECT * FROM traffic").to_pylist(), run)
    trace_rollouts(ws, rollouts, run)
    return ws


def test_forget_a_user_removes_their_bytes_and_lists_what_was_trained_on_them(ws: Workspace, capsys) -> None:
    root = ws.root
    before = holding(root, SECRET)
    assert {"mlflow.db"} < set(before) and any(p.startswith("data/traffic/") for p in before)  # the search finds it
    assert any(p.startswith("data/rollouts/") for p in before) and any(p.startswith("cache/judge") for p in before)
    lineage = ws.query("SELECT DISTINCT policy_id, how FROM traffic_lineage WHERE user_id = 'alice' ORDER BY 1").to_pylist()
    assert lineage == [{"policy_id": "ck-1", "how": "trained"}, {"policy_id": "ck-2", "how": "descendant"}]
    served = len(search(ws, {"rlops.kind": "served"}))

    capsys.readouterr()
    assert main(["traffic", "forget", "--user", "alice", "--workspace", str(root), "--json"]) == 0
    out = capsys.readouterr()
    assert [json.loads(line)["policy_id"] for line in out.out.splitlines()] == ["ck-1", "ck-2"]
    assert "2 checkpoint(s) were trained on their scenarios" in out.err and "2 calls" in out.err

    assert holding(root, SECRET) == []
    # Carol asked the same question: her call is hers and stays, while what was re-sampled from the shared scenario
    # (trained on alice's data too) is gone, with its traces, hers included.
    assert [p.split("/")[1] for p in holding(root, SECRET.upper())] == ["traffic"]
    assert holding(root, OTHER)  # bob's stays
    assert sorted(r["user_id"] for r in ws.query("SELECT user_id FROM traffic").to_pylist()) == ["bob", "carol"]
    assert [r["episode_id"] for r in ws.query("SELECT episode_id FROM feedback").to_pylist()] == ["eb-1"]
    kept = ws.query("SELECT DISTINCT prompt_id FROM rollouts").to_pylist()
    assert len(kept) == 1 and ws.query("SELECT count(*) AS n FROM rewards").to_pylist()[0]["n"] == 2
    assert ws.query("SELECT count(*) AS n FROM labels").to_pylist()[0]["n"] == 0  # the label was on alice's rollout
    assert ws.query("SELECT count(*) AS n FROM verdicts").to_pylist()[0]["n"] == 1
    assert ws.catalog.get_artifact("ro-traffic")["rows"] == 2  # the catalog follows the rewritten file
    assert len(search(ws, {"rlops.kind": "served"})) == served - 3 and len(search(ws, {"rlops.kind": "trained"})) == 2
    (row,) = ws.query("SELECT * FROM forgotten").to_pylist()
    assert (row["scope"], row["traffic_rows"], row["feedback_rows"], row["rollout_rows"], row["verdict_rows"]) == (
        "user", 2, 1, 4, 2)
    assert [c["policy_id"] for c in json.loads(row["checkpoints"])] == ["ck-1", "ck-2"] and "alice" not in str(row)


def test_forgetting_someone_with_no_traffic_is_an_error_that_changes_nothing(ws: Workspace, capsys) -> None:
    files = {p: p.stat().st_mtime_ns for p in (ws.root / "data").rglob("*.parquet")}
    assert main(["traffic", "forget", "--session", "nobody", "--workspace", str(ws.root)]) == 1
    assert "no traffic of session 'nobody'" in capsys.readouterr().err
    assert files == {p: p.stat().st_mtime_ns for p in (ws.root / "data").rglob("*.parquet")}
