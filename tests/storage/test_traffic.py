"""The traffic log (storage/traffic.py): buffered appends as whole parts, merges of small parts, feedback checked
before anything is written, content keys, and what a killed writer leaves behind."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from storage.traffic import FeedbackError, TrafficLog, TrafficSettings, compact, content_key, input_key, recorded, remove_orphans
from storage.workspace import Workspace
from tests.factories import SERVED_T0, served_call

T0 = SERVED_T0


def call(i: int, episode: str | None = None, user: str | None = None) -> dict[str, Any]:
    return served_call(i, episode=episode, user=user)


def count(ws: Workspace, table: str) -> int:
    return ws.query(f"SELECT count(*) AS n FROM {table}").to_pylist()[0]["n"]


def files(ws: Workspace, kind: str) -> list[Path]:
    return sorted(p for p in (Path(ws.data.base) / kind).glob("*/*") if p.is_file())


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    return Workspace.open(tmp_path / "ws")


def test_calls_are_buffered_then_written_as_one_part_and_read_with_sql(ws: Workspace) -> None:
    log = TrafficLog(ws, TrafficSettings(flush_calls=100, flush_seconds=3600))
    try:
        for i in range(5):
            log.add(call(i, user="alice" if i < 2 else "bob"))
        assert count(ws, "traffic") == 0  # buffered: nothing is written before a flush
        part = log.flush()
        assert count(ws, "traffic") == 5 and len(files(ws, "traffic")) == 1
        row = ws.query("SELECT * FROM traffic WHERE call_id = 'chatcmpl-1'").to_pylist()[0]
        assert (row["user_id"], row["server_id"], row["reply"], row["messages"][1]["content"]) == (
            "alice", log.server_id, "2", "What is 1 + 1?")
        meta = ws.catalog.get_artifact(part)["meta"]
        assert (meta["gen"], meta["first"], meta["last"]) == (0, T0.isoformat(), (T0 + timedelta(seconds=4)).isoformat())
        assert log.flush() is None  # nothing buffered, nothing written
    finally:
        log.close()


def test_a_full_buffer_is_flushed_without_waiting_and_close_writes_the_rest(ws: Workspace) -> None:
    log = TrafficLog(ws, TrafficSettings(flush_calls=3, flush_seconds=3600))
    for i in range(4):
        log.add(call(i))
    deadline = time.monotonic() + 30
    while count(ws, "traffic") < 3:  # the flusher thread wrote the first three on its own
        assert time.monotonic() < deadline
        time.sleep(0.05)
    log.close()
    assert count(ws, "traffic") == 4


def test_small_parts_are_merged_by_generation_keeping_every_row(ws: Workspace) -> None:
    settings = TrafficSettings(flush_calls=1000, flush_seconds=3600, fan_in=3)
    log = TrafficLog(ws, settings)
    try:
        for i in range(10):  # ten flushes of one call: 3+3+3 -> three gen-1 parts -> one gen-2 part, and one left
            log.add(call(i))
            log.flush()
    finally:
        log.close()
    gens = sorted(a["meta"]["gen"] for a in ws.catalog.artifacts("traffic"))
    assert gens == [0, 2]
    assert len(files(ws, "traffic")) == 2  # the merged-away files are deleted, not only unregistered
    assert sorted(r["call_id"] for r in ws.query("SELECT call_id FROM traffic").to_pylist()) == sorted(
        f"chatcmpl-{i}" for i in range(10))
    big = TrafficSettings(fan_in=2, max_part_bytes=1)  # a merge that would pass the size bound is not made
    assert compact(ws, "traffic", big) == 0


def test_feedback_is_checked_before_anything_is_written(ws: Workspace) -> None:
    log = TrafficLog(ws, TrafficSettings(flush_calls=100, flush_seconds=3600, fan_in=2))  # feedback parts merged too
    try:
        log.add(call(0, episode="ep-known"))  # buffered only: feedback may already name it
        fid = log.feedback("ep-known", score=1.0, label="good", comment="right", who="alice", key="correctness")
        log.flush()
        log.feedback("ep-known", score=0.25, call_id="chatcmpl-0")
        for bad, message in [({"score": 1.5}, "score: a number in [0, 1]"), ({"score": float("nan")}, "score"),
                             ({"score": True}, "score"), ({}, "give a score, a label or a comment"),
                             ({"comment": "x" * 5000}, "comment: a string of at most 2000")]:
            with pytest.raises(FeedbackError, match=message.replace("[", r"\[").replace("]", r"\]")):
                log.feedback("ep-known", **bad)
        with pytest.raises(KeyError, match="no recorded call of episode 'ep-unknown'"):
            log.feedback("ep-unknown", score=1.0)
        with pytest.raises(KeyError, match="has no recorded call 'chatcmpl-9'"):
            log.feedback("ep-known", score=1.0, call_id="chatcmpl-9")
    finally:
        log.close()
    assert len(files(ws, "feedback")) == 1  # two parts, merged by the next flush
    got = ws.query("SELECT feedback_id, key, score, label, who, call_id FROM feedback ORDER BY created_at").to_pylist()
    assert [(r["key"], r["score"], r["label"], r["who"], r["call_id"]) for r in got] == [
        ("correctness", 1.0, "good", "alice", None), ("feedback", 0.25, None, None, "chatcmpl-0")]
    assert got[0]["feedback_id"] == fid


def test_content_keys_ignore_case_and_spacing_and_recording_a_fraction_is_stable() -> None:
    def convo(text: str) -> list[dict]:
        return [{"role": "user", "content": text, "tool_calls": []}]

    assert content_key(convo("What is  2+2 ?")) == content_key(convo("what is 2+2 ?\n"))
    assert content_key(convo("What is 2+2?")) != content_key(convo("What is 2+3?"))
    assert input_key(convo("Hi")).startswith("in-") and input_key([{"role": "system", "content": "x"}]) is None
    calls = [{"role": "assistant", "content": None, "tool_calls": [{"id": "a", "name": "search",
                                                                      "arguments": json.dumps({"q": 1, "k": 2})}]}]
    spaced = [{**calls[0], "tool_calls": [{"id": "b", "name": "search", "arguments": '{"k": 2,  "q": 1}'}]}]
    assert content_key(calls) == content_key(spaced)  # arguments by meaning, call ids not at all
    kept = [k for k in (f"ep-{i}" for i in range(2000)) if recorded(k, 0.25)]
    assert 400 < len(kept) < 600 and kept == [k for k in (f"ep-{i}" for i in range(2000)) if recorded(k, 0.25)]
    assert all(recorded(f"ep-{i}", 1.0) for i in range(10))


def test_what_a_killed_writer_left_is_invisible_and_removed_by_the_next_log(ws: Workspace) -> None:
    log = TrafficLog(ws, TrafficSettings(flush_calls=100, flush_seconds=3600))
    log.add(call(0))
    log.close()
    # A flush killed after its file and before its registration, and a temp file of a write killed mid-way.
    orphan = Path(ws.data.base) / "traffic" / "tr-killed" / "part-00000.parquet"
    orphan.parent.mkdir(parents=True)
    pq.write_table(ws.read_artifact(ws.catalog.artifacts("traffic")[0]["artifact_id"]), orphan)
    temp = Path(ws.data.base) / "traffic" / "tr-killed" / ".part-00000.parquet.1a2b3c4d.tmp"
    temp.write_bytes(b"half a file")
    assert count(ws, "traffic") == 1  # never listed by a reader
    assert sorted(remove_orphans(ws)) == sorted([str(orphan), str(temp)])
    assert not orphan.parent.exists() and count(ws, "traffic") == 1
