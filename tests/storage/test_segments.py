"""Rollout segments in the schema: stored, read back, and version-1 files (no column) still readable."""

from __future__ import annotations

import pyarrow.parquet as pq

from storage.parquet import FileInfo
from storage.schema import Rollout, from_table, segment_bounds, to_table
from tests.factories import tool_episode


def test_segment_bounds_cover_the_tokens_once():
    assert segment_bounds([], 7) == [(0, 7)]
    assert segment_bounds(None, 7) == [(0, 7)]
    assert segment_bounds([3, 5], 7) == [(0, 3), (3, 5), (5, 7)]


def test_segments_round_trip_and_version_1_files_read_as_one_segment(ws):
    two = tool_episode("ro-new", 0, 0)
    two.segment_starts = [10]
    ws.write_part("rollouts", "ro-new", to_table([two]), part="part-0")
    ws.catalog.complete_artifact("ro-new", "rollouts", "rollout", [], "cfg")

    # A file written before schema version 2: the same row without the segment_starts column.
    old = tool_episode("ro-old", 0, 0)
    table = to_table([old]).drop_columns(["segment_starts"])
    folder = ws.data.artifact_dir("rollouts", "ro-old")
    path = f"{folder}/part-0.parquet"
    import os

    os.makedirs(folder, exist_ok=True)
    pq.write_table(table, path)
    ws.catalog.register_file("ro-old", "rollouts", FileInfo(path, 1, os.path.getsize(path)), "part-0")
    ws.catalog.complete_artifact("ro-old", "rollouts", "rollout", [], "cfg")

    assert from_table(ws.read_artifact("ro-old"), Rollout)[0].segments() == [(0, old.num_tokens)]
    rows = ws.query("SELECT batch_id, segment_starts FROM rollouts ORDER BY batch_id").to_pylist()
    assert rows == [{"batch_id": "ro-new", "segment_starts": [10]}, {"batch_id": "ro-old", "segment_starts": None}]
    back = {r.batch_id: r for r in from_table(ws.query("SELECT * FROM rollouts"), Rollout)}
    assert back["ro-new"].segments() == [(0, 10), (10, two.num_tokens)]
    assert back["ro-old"].segment_starts == [] and back["ro-old"].token_ids == old.token_ids
