"""Schemas, Parquet writer, catalog and views, with real Parquet files and a real DuckDB."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from storage.ids import artifact_id
from storage.schema import ROLLOUTS, Rollout, from_table, to_table
from storage.sql import Sandbox
from tests.factories import tool_episode
from tests.storage.conftest import add_batch


def test_multi_turn_rollout_round_trips_through_parquet_and_duckdb(ws):
    original = add_batch(ws, "ro-a", groups=1, size=2)
    table = ws.query("SELECT * FROM rollouts ORDER BY rollout_id")
    back = from_table(table, Rollout)
    assert [r.rollout_id for r in back] == sorted(r.rollout_id for r in original)
    by_id = {r.rollout_id: r for r in original}
    for r in back:
        o = by_id[r.rollout_id]
        assert r.messages == o.messages  # roles, contents, tool calls with ids/arguments, tool_call_id, name
        assert r.messages[2].tool_calls[0].name == "search"
        assert r.messages[3].tool_call_id == "call_0_0"
        assert r.token_ids == o.token_ids and r.loss_mask == o.loss_mask
        assert r.behavior_logprobs == pytest.approx(o.behavior_logprobs, abs=1e-6)  # stored as float32
        assert r.metadata == o.metadata and r.sampling == o.sampling
        assert r.created_at == o.created_at
    files = ws.catalog.artifact_files("ro-a")
    assert pq.read_schema(files[0]["path"]).equals(ROLLOUTS, check_metadata=False)


def test_join_rollouts_and_rewards_just_works(ws):
    add_batch(ws, "ro-a")
    add_batch(ws, "ro-b", reward_version="v2")
    t = ws.query("SELECT batch_id, reward_version, avg(value) AS mean, count(*) AS n "
                 "FROM rollouts JOIN rewards USING (rollout_id, batch_id) GROUP BY ALL ORDER BY batch_id")
    assert t.to_pylist() == [
        {"batch_id": "ro-a", "reward_version": "v1", "mean": 0.5, "n": 8},
        {"batch_id": "ro-b", "reward_version": "v2", "mean": 0.5, "n": 8},
    ]


def test_incomplete_artifact_is_invisible_until_completed(ws):
    add_batch(ws, "ro-a")
    ws.write_part("rollouts", "ro-half", to_table([tool_episode("ro-half", 0, 0)]), part="group-00000")
    assert ws.query("SELECT count(*) AS n FROM rollouts").to_pylist() == [{"n": 8}]
    assert ws.catalog.get_artifact("ro-half") is None
    ws.catalog.complete_artifact("ro-half", "rollouts", "rollout", [], "cfg")
    assert ws.query("SELECT count(*) AS n FROM rollouts").to_pylist() == [{"n": 9}]
    assert ws.catalog.get_artifact("ro-half")["rows"] == 1


def test_rewriting_a_part_replaces_it_whole(ws):
    ws.write_part("rollouts", "ro-x", to_table([tool_episode("ro-x", 0, 0)]), part="group-00000")
    ws.write_part("rollouts", "ro-x", to_table([tool_episode("ro-x", 0, 1)]), part="group-00000")
    assert len(ws.catalog.artifact_files("ro-x")) == 1
    assert ws.read_artifact("ro-x").num_rows == 1


def test_corrupt_parquet_file_is_named_and_other_batches_stay_queryable(ws, capsys):
    add_batch(ws, "ro-good")
    add_batch(ws, "ro-bad")
    bad = ws.catalog.artifact_files("ro-bad")[0]["path"]
    with open(bad, "r+b") as f:  # clobber the footer
        f.seek(-64, 2)
        f.write(b"\0" * 64)
    sandbox = Sandbox(ws.settings)
    assert [p for p, _ in sandbox.skipped] == [bad]
    sandbox.warn_skipped()
    assert bad in capsys.readouterr().err
    rows = sandbox.query("SELECT batch_id, count(*) AS n FROM rollouts GROUP BY 1 ORDER BY 1").to_pylist()
    assert rows == [{"batch_id": "ro-bad", "n": 4}, {"batch_id": "ro-good", "n": 8}]  # the bad batch's other group survives


def test_artifact_ids_are_deterministic_and_input_sensitive():
    a = artifact_id("rollout", ["ck-1"], {"n": 4, "g": 8})
    assert a == artifact_id("rollout", ["ck-1"], {"g": 8, "n": 4}) and a.startswith("ro-")
    assert a != artifact_id("rollout", ["ck-2"], {"n": 4, "g": 8})
    assert a != artifact_id("rollout", ["ck-1"], {"n": 4, "g": 8}, version="2")


def test_checkpoints_stage_runs_and_runs_round_trip(ws):
    ws.catalog.add_checkpoint({"policy_id": "ck-1", "parent_id": "base", "base_model": "m", "kind": "grpo",
                               "adapter_uri": "/x", "step": 1, "trained_on": {"batches": ["ro-a"]}, "config_hash": "h"})
    ws.catalog.record_stage_run({"stage": "grpo", "artifact_id": "ck-1", "inputs": ["ro-a"], "status": "complete"})
    ws.catalog.upsert_run("nightly", {"a": 1}, "mlf-1", "running")
    ws.catalog.upsert_run("nightly", {"a": 1}, "mlf-1", "complete")
    assert ws.catalog.get_checkpoint("ck-1")["trained_on"] == {"batches": ["ro-a"]}
    assert [r["status"] for r in ws.catalog.runs()] == ["complete"]
    assert ws.query("SELECT policy_id, stage FROM checkpoints JOIN stage_runs ON policy_id = artifact_id").to_pylist() == [
        {"policy_id": "ck-1", "stage": "grpo"}
    ]


def test_write_artifacts_publishes_several_at_once_and_reward_table_matches_records(ws):
    from storage.schema import RewardRow, now, reward_table

    at = now()
    rows = [RewardRow("r1", "ro-x", "m", "v1", 1.0, {"k": [1, 2]}, None, "rw-a", at),
            RewardRow("r2", "ro-x", "m", "v1", None, None, "ValueError: bad", "rw-a", at)]
    table = reward_table(["r1", "r2"], "ro-x", "m", "v1", [1.0, None], [{"k": [1, 2]}, None],
                         [None, "ValueError: bad"], "rw-a", at)
    assert table.equals(to_table(rows, RewardRow))
    other = reward_table(["r1"], "ro-x", "n", "v1", [0.5], ['{"pre": "encoded"}'], [None], "rw-b", at)
    assert ws.catalog.complete_ids(["rw-a", "rw-b"]) == set()

    ws.write_artifacts("rewards", "score", [("rw-a", table, ["ro-x"], "h1", {"reward_name": "m"}),
                                           ("rw-b", other, ["ro-x"], "h2", None)])
    assert ws.catalog.complete_ids(["rw-a", "rw-b", "rw-c"]) == {"rw-a", "rw-b"}
    assert {a: len(p) for a, p in ws.catalog.files_of(["rw-a", "rw-b", "rw-c"]).items()} == {"rw-a": 1, "rw-b": 1, "rw-c": 0}
    assert ws.catalog.get_artifact("rw-a")["rows"] == 2 and ws.catalog.get_artifact("rw-a")["meta"] == {"reward_name": "m"}
    got = ws.query("SELECT reward_name, value, details, error FROM rewards ORDER BY reward_name, rollout_id").to_pylist()
    assert got == [{"reward_name": "m", "value": 1.0, "details": '{"k": [1, 2]}', "error": None},
                   {"reward_name": "m", "value": None, "details": None, "error": "ValueError: bad"},
                   {"reward_name": "n", "value": 0.5, "details": '{"pre": "encoded"}', "error": None}]


def test_the_catalog_file_is_open_only_inside_a_call_and_calls_nest(ws):
    """Catalog calls attach the file to one in-memory DuckDB per process and detach it after: between calls
    another process can write it (DuckDB allows one writing process per file), and a call made inside
    another's connection (the lock is re-entrant) reads the same attached file."""
    import subprocess
    import sys

    add_batch(ws, "ro-open", groups=1, size=2, reward_version=None)
    with ws.catalog.connect() as con:
        assert con.execute("SELECT count(*) FROM artifacts").fetchone()[0] == 1
        assert ws.catalog.get_artifact("ro-open")["rows"] == 2  # nested: a cursor of its own on the same file
        other = subprocess.run([sys.executable, "-c", "import duckdb, sys; duckdb.connect(sys.argv[1])",
                                str(ws.catalog.path)], capture_output=True, text=True)
        assert other.returncode != 0 and "lock" in other.stderr  # held while a call is inside
    with ws.catalog.connect(write=False):
        with pytest.raises(RuntimeError, match="cannot open inside one"):
            with ws.catalog.connect(write=True):  # writing inside a read-only call: refused, not a DuckDB error
                pass
    script = "import duckdb, sys; c = duckdb.connect(sys.argv[1]); c.execute('CREATE TABLE written_by_another (x INT)')"
    subprocess.run([sys.executable, "-c", script, str(ws.catalog.path)], check=True)
    assert ws.catalog.get_artifact("ro-open")["rows"] == 2  # and this process attaches it again after
    with ws.catalog.connect(write=False) as con:
        assert con.execute("SELECT count(*) FROM written_by_another").fetchone()[0] == 0


def test_a_workspaces_views_are_brought_up_to_date_only_when_what_they_read_changed(ws, monkeypatch):
    """Workspace.query reuses its views while the catalog, the files they read and the stored images are
    unchanged (storage/sql.py ViewCache), and after each change brings them up to date on the same connection; each
    answer is what freshly made views give, the damaged file named as they name it."""
    import storage.sql
    from storage.images import ImageStore
    from tests.storage.test_images import encoded

    made, refreshed = [], []
    real_open, real_refresh = storage.sql.open_views, storage.sql.refresh_views
    monkeypatch.setattr(storage.sql, "open_views", lambda settings, *a: made.append(1) or real_open(settings, *a))
    monkeypatch.setattr(storage.sql, "refresh_views", lambda views, *a: refreshed.append(1) or real_refresh(views, *a))
    checks = ["SELECT count(*) AS n FROM rollouts", "SELECT count(*) AS n FROM rewards", "SELECT count(*) AS n FROM images",
              "SELECT batch_id, count(*) AS n FROM rollouts JOIN rewards USING (rollout_id, batch_id) GROUP BY ALL ORDER BY ALL",
              "SELECT artifact_id, status FROM artifacts ORDER BY ALL", "SELECT count(*) AS n FROM files"]

    def answers() -> tuple[list, list]:
        """(what the workspace's views answer, what fresh views answer): each query of `checks`, and the skipped files."""
        cached = [ws.query(sql).to_pylist() for sql in checks]
        fresh = real_open(ws.settings)
        try:
            return ([*cached, ws._views._views.skipped],
                    [*(fresh.con.sql(sql).to_arrow_table().to_pylist() for sql in checks), fresh.skipped])
        finally:
            fresh.con.close()

    add_batch(ws, "ro-a")
    got, want = answers()
    assert got == want and got[0] == [{"n": 8}] and (len(made), len(refreshed)) == (1, 0)  # one set of views for all
    add_batch(ws, "ro-b")  # the catalog changed: its snapshots are replaced
    got, want = answers()
    assert got == want and got[0] == [{"n": 16}] and (len(made), len(refreshed)) == (1, 1)
    bad = ws.catalog.artifact_files("ro-b")[0]["path"]
    with open(bad, "r+b") as f:  # a file the views read is damaged: left out, as fresh views leave it
        f.seek(-64, 2)
        f.write(b"\0" * 64)
    got, want = answers()
    assert got == want and got[0] == [{"n": 12}] and [p for p, _ in got[-1]] == [bad] and len(refreshed) == 2
    ImageStore(ws.settings.images_dir).put(encoded((1, 2, 3)))  # an image stored
    got, want = answers()
    assert got == want and got[2] == [{"n": 1}] and len(refreshed) == 3
    got, want = answers()  # nothing changed
    assert got == want and (len(made), len(refreshed)) == (1, 3)