"""What `rlops serve` answered, kept: batched, crash-safe appends of served calls and feedback to the workspace.

    log = TrafficLog(ws, TrafficSettings(flush_calls=64, flush_seconds=5.0))
    log.add(row)                         # a served call (storage/loop_schema.py `traffic`); buffered
    log.feedback(episode_id, score=1.0)  # written at once; FeedbackError (a 400) or KeyError (a 404) writes nothing
    log.close()                          # flushes what is buffered (a SIGKILL loses at most that)

A flush writes the buffered calls as one Parquet part (temp file, fsync, rename) and registers it as one complete
`traffic` artifact, under the catalog's lock (storage/catalog.py `connect`): a part is visible whole or not at all,
and a killed server leaves whole files only. Small parts are merged as they accumulate (`compact`): `fan_in` parts
of one generation become one part of the next, while a part stays under `max_part_bytes`, so a year of traffic is
a few hundred files, and SQL over a million calls reads a handful of them. The merge publishes the new part and
drops the old ones in one catalog transaction, then deletes the old files; a merge killed halfway leaves an
unregistered file, which no reader lists and the next log's start removes (`remove_orphans`).

Traffic is the one table that changes after it is written: compaction and forgetting a person
(storage/forget.py) rewrite its files. Both hold the catalog's lock for the whole change, as flushes do.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from storage.catalog import Published
from storage.ids import canonical_json
from storage.schema import SCHEMA_VERSION, TABLES, now

if TYPE_CHECKING:
    from storage.workspace import Workspace

KINDS = ("traffic", "feedback")
MAX_TEXT = 2000  # characters of a feedback comment or label: a remark, not a document
MAX_KEY = 128


@dataclass(frozen=True)
class TrafficSettings:
    """How `rlops serve` keeps what it answers (`--record`, `--flush-calls`, `--flush-seconds`)."""

    # The share of episodes recorded (a call without an episode is sampled by its own id): 1 all, 0 none. Decided by a
    # hash, so an episode is recorded whole or not at all, the same way on every server.
    fraction: float = 1.0
    flush_calls: int = 64  # a part per this many calls: a SIGKILL loses at most these (and `flush_seconds`' worth)
    flush_seconds: float = 5.0  # ... or after this long, so a quiet server's calls reach SQL soon
    fan_in: int = 8  # parts of one generation merged into one of the next
    max_part_bytes: int = 64 << 20  # a merge whose result would pass this is not made (its memory is the bound)


def recorded(key: str, fraction: float) -> bool:
    """Whether the calls of `key` (an episode id, else the call's id) are recorded at `fraction`: a stable hash."""
    if fraction >= 1.0:
        return True
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 2**32 < fraction


_SPACE = re.compile(r"\s+")


def _norm(text: str | None) -> str:
    return _SPACE.sub(" ", (text or "").strip()).casefold()


def content_key(messages: list[dict[str, Any]], prefix: str = "sc") -> str:
    """`<prefix>-<16 hex>` of a conversation's meaning, with case and whitespace normalised: two users who asked the
    same thing (`What is 2+2 ?` and `what is 2+2 ?`) have one key. Tool calls count by name and parsed arguments."""
    def calls(m: dict[str, Any]) -> list:
        out = []
        for c in m.get("tool_calls") or []:
            try:
                args = json.loads(c["arguments"])
            except (ValueError, TypeError):
                args = _norm(c["arguments"])
            out.append([c["name"], args])
        return out

    meaning = [[m["role"], _norm(m.get("content")), calls(m)] for m in messages]
    return f"{prefix}-{hashlib.sha256(canonical_json(meaning).encode()).hexdigest()[:16]}"


def input_key(messages: list[dict[str, Any]]) -> str | None:
    """The key of a conversation's first user message (what an agent is re-run on); None without one."""
    first = next((m for m in messages if m["role"] == "user"), None)
    return None if first is None else content_key([{"role": "user", "content": first.get("content")}], "in")


class FeedbackError(ValueError):
    """Feedback that cannot be stored; the message names the field (the server answers it as a 400)."""


class TrafficLog:
    """The served calls of one server process, buffered and flushed to the workspace; its feedback written at once."""

    def __init__(self, ws: Workspace, settings: TrafficSettings = TrafficSettings(), server_id: str | None = None) -> None:
        self.ws, self.settings = ws, settings
        self.server_id = server_id or f"sv-{uuid.uuid4().hex[:12]}"
        self._rows: list[dict[str, Any]] = []
        self._episodes: set[str] = set()  # episodes of buffered calls: feedback may name them before a flush
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._written = False  # a part was written since the last merge
        self.flushes = 0
        remove_orphans(ws)
        self._thread = threading.Thread(target=self._loop, name="traffic-flusher", daemon=True)
        self._thread.start()

    def add(self, row: dict[str, Any]) -> None:
        """Buffer one served call (the `traffic` columns but `server_id` and `schema_version`, filled here)."""
        with self._lock:
            self._rows.append({**row, "server_id": self.server_id, "schema_version": SCHEMA_VERSION})
            if row.get("episode_id"):
                self._episodes.add(row["episode_id"])
            full = len(self._rows) >= self.settings.flush_calls
        if full:
            self._wake.set()

    def _loop(self) -> None:
        while not self._closed:
            self._wake.wait(self.settings.flush_seconds)
            self._wake.clear()
            try:
                self.flush()
            except Exception as e:  # noqa: BLE001 - a failed flush keeps its rows buffered and says why; serving goes on
                print(f"warning: traffic flush failed (kept in memory, retried): {type(e).__name__}: {e}", flush=True)

    def flush(self) -> str | None:
        """Write the buffered calls as one part; returns its artifact id (None when nothing was buffered). Then merge
        parts that accumulated (`compact`)."""
        with self._lock:
            rows, self._rows = self._rows, []
            episodes, self._episodes = self._episodes, set()
        part = None
        if rows:
            try:
                part = _publish(self.ws, "traffic", pa.Table.from_pylist(rows, schema=TABLES["traffic"]),
                                {"server_id": self.server_id, "gen": 0})
            except BaseException:
                with self._lock:  # back in front, in order: the next flush tries again
                    self._rows, self._episodes = rows + self._rows, episodes | self._episodes
                raise
            self.flushes += 1
            self._written = True
        if self._written:  # parts were added since the last merge (calls, or feedback written at once)
            self._written = False
            for kind in KINDS:
                compact(self.ws, kind, self.settings)
        return part

    def close(self) -> None:
        """Stop the flusher and write what is buffered."""
        self._closed = True
        self._wake.set()
        self._thread.join()
        self.flush()

    def knows(self, episode_id: str) -> bool:
        """Whether any call of `episode_id` was recorded: buffered here, or in the workspace's traffic."""
        with self._lock:
            if episode_id in self._episodes:
                return True
        return bool(self.ws.query("SELECT 1 FROM traffic WHERE episode_id = ? LIMIT 1", [episode_id]).num_rows)

    def feedback(self, episode_id: str, *, score: float | None = None, label: str | None = None,
                 comment: str | None = None, who: str | None = None, key: str | None = None,
                 call_id: str | None = None) -> str:
        """Store one piece of feedback on a recorded episode (or one of its calls); returns its id. FeedbackError
        names a field out of range; KeyError an unknown episode. Nothing is written then."""
        row = feedback_row(episode_id, score=score, label=label, comment=comment, who=who, key=key, call_id=call_id)
        if not self.knows(episode_id):
            raise KeyError(f"no recorded call of episode {episode_id!r}")
        if call_id is not None and not self._call_of(episode_id, call_id):
            raise KeyError(f"episode {episode_id!r} has no recorded call {call_id!r}")
        _publish(self.ws, "feedback", pa.Table.from_pylist([{**row, "server_id": self.server_id}], schema=TABLES["feedback"]),
                 {"server_id": self.server_id, "gen": 0, "episode_id": episode_id})
        self._written = True  # merged with the others at the next flush
        return row["feedback_id"]

    def _call_of(self, episode_id: str, call_id: str) -> bool:
        with self._lock:
            if any(r["call_id"] == call_id and r.get("episode_id") == episode_id for r in self._rows):
                return True
        return bool(self.ws.query("SELECT 1 FROM traffic WHERE episode_id = ? AND call_id = ? LIMIT 1",
                                  [episode_id, call_id]).num_rows)


def feedback_row(episode_id: str, *, score: float | None, label: str | None, comment: str | None, who: str | None,
                 key: str | None, call_id: str | None) -> dict[str, Any]:
    """A `feedback` row, checked: a score in [0, 1], texts bounded; at least a score, a label or a comment."""
    if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score)
                              or not 0.0 <= score <= 1.0):
        raise FeedbackError(f"score: a number in [0, 1] (normalise a rating: 4 of 5 is 0.75), got {score!r}")
    for name, text, limit in (("label", label, MAX_KEY), ("comment", comment, MAX_TEXT), ("who", who, MAX_KEY),
                              ("key", key, MAX_KEY)):
        if text is not None and (not isinstance(text, str) or len(text) > limit):
            raise FeedbackError(f"{name}: a string of at most {limit} characters")
    if score is None and not label and not comment:
        raise FeedbackError("score: give a score, a label or a comment (or several)")
    return {"feedback_id": f"fb-{uuid.uuid4().hex[:16]}", "episode_id": episode_id, "call_id": call_id,
            "key": key or "feedback", "score": None if score is None else float(score), "label": label,
            "comment": comment, "who": who, "created_at": now(), "schema_version": SCHEMA_VERSION}


def _publish(ws: Workspace, kind: str, table: pa.Table, meta: dict[str, Any]) -> str:
    """One part written and registered as a complete artifact of `kind`, under the catalog's lock (so a forget or a
    merge never runs between the file's write and its registration); returns the artifact's id."""
    artifact = f"{kind[:2]}-{uuid.uuid4().hex[:16]}"  # an event, not derived from content
    times = table["served_at" if kind == "traffic" else "created_at"]
    meta = {**meta, "first": pc.min(times).as_py().isoformat(), "last": pc.max(times).as_py().isoformat()}
    with ws.catalog.connect():
        info = ws.data.write(kind, artifact, table, part="part-00000")
        ws.catalog.publish(kind, "serve", [Published(artifact, info, "part-00000", [], "", meta)])
    return artifact


def compact(ws: Workspace, kind: str, settings: TrafficSettings) -> int:
    """Merge parts of `kind` that accumulated: the oldest `fan_in` of a generation into one of the next, while the
    merged part stays under `max_part_bytes`. Returns the merges made. Holds the catalog's lock throughout."""
    merges = 0
    with ws.catalog.connect():
        while True:
            parts = ws.catalog.rows(
                "SELECT a.artifact_id, CAST(a.meta->>'gen' AS INTEGER) AS gen, f.path, f.bytes FROM artifacts a "
                "JOIN files f USING (artifact_id) WHERE a.kind = ? AND a.status = 'complete' ORDER BY a.completed_at", [kind])
            by_gen: dict[int, list[dict[str, Any]]] = {}
            for p in parts:
                p["gen"] = p["gen"] or 0  # a part written without one (feedback before it had one) is a first one
                by_gen.setdefault(p["gen"], []).append(p)
            batch = next((ps[: settings.fan_in] for g, ps in sorted(by_gen.items()) if len(ps) >= settings.fan_in
                          and sum(p["bytes"] for p in ps[: settings.fan_in]) <= settings.max_part_bytes), None)
            if batch is None:
                return merges
            table = ws.data.read([p["path"] for p in batch])
            order = "served_at" if kind == "traffic" else "created_at"
            table = table.sort_by(order)
            merged = f"{kind[:2]}-{uuid.uuid4().hex[:16]}"
            meta = {"gen": batch[0]["gen"] + 1, "merged": len(batch),
                    "first": pc.min(table[order]).as_py().isoformat(), "last": pc.max(table[order]).as_py().isoformat()}
            info = ws.data.write(kind, merged, table, part="part-00000")
            ws.catalog.replace_artifacts(kind, "compact", [Published(merged, info, "part-00000", [], "", meta)],
                                         [p["artifact_id"] for p in batch])
            for p in batch:
                _delete(ws, p["path"])
            merges += 1


def _delete(ws: Workspace, path: str) -> None:
    """Remove a data file (and its artifact folder when that is left empty)."""
    if ws.data.delete(path) and ws.data.local:
        folder = Path(path).parent
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def remove_orphans(ws: Workspace) -> list[str]:
    """Delete the traffic and feedback files no catalog row registers (a write or merge killed between its file and its
    transaction) and temp files left by killed writers; returns them. Under the catalog's lock, where every writer of
    these kinds registers what it writes, so nothing unregistered is still being written. Local data roots only."""
    if not ws.data.local:
        return []
    removed = []
    with ws.catalog.connect():
        registered = {r["path"] for r in ws.catalog.rows("SELECT path FROM files WHERE list_contains(?, kind)", [list(KINDS)])}
        for kind in KINDS:
            root = Path(ws.data.base) / kind
            for path in root.glob("*/*") if root.is_dir() else []:
                if path.is_file() and str(path) not in registered:
                    removed.append(str(path))
                    _delete(ws, str(path))
    return removed
