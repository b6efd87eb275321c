"""People's labels of episodes: append-only rows in the workspace, checked, written and read back.

    sid = append_labels(ws, [Label(...), ...])     # one submission: a grade, or an ordering of a group
    values = label_values(ws)                      # rollout id -> reviewer -> value, from the current labels

A submission (one grade, or one ordering of a group) is one Parquet file written atomically and registered in
the catalog as one complete `labels` artifact, in that order: a label is visible whole or not at all, and never
overwritten. A later submission by the same reviewer on the same episode (a grade) or group (an ordering)
supersedes the earlier one, which stays in the table. What the labels say is SQL: the views of
storage/label_views.py (`labels`, `label_values`, `label_pairs`, the agreement views).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from storage.ids import config_hash
from storage.schema import Label, now, to_table

if TYPE_CHECKING:
    from storage.workspace import Workspace

MAX_NOTE = 2000  # characters: a note is a remark, not a document
MAX_REVIEWER = 64


class LabelError(ValueError):
    """A label that cannot be written; the message names the problem (the review server answers it as a 4xx)."""


@dataclass(frozen=True)
class EpisodeKey:
    """Where an episode sits: what a label records next to its rollout id, so group-level SQL needs no join."""

    rollout_id: str
    batch_id: str
    group_id: str


def new_submission_id() -> str:
    """A submission's id: random, not derived from content (a label is an event; the same grade given twice is
    two submissions, the later one current)."""
    return f"lb-{uuid.uuid4().hex[:16]}"


def _checked(reviewer: str, note: str | None) -> tuple[str, str | None]:
    reviewer = reviewer.strip()
    if not reviewer or len(reviewer) > MAX_REVIEWER or not reviewer.isprintable():
        raise LabelError(f"reviewer: a name of 1 to {MAX_REVIEWER} printable characters, got {reviewer!r}")
    if note is not None and len(note) > MAX_NOTE:
        raise LabelError(f"note: at most {MAX_NOTE} characters, got {len(note)}")
    return reviewer, (note or None)


def grade(workspace_id: str, reviewer: str, episode: EpisodeKey, value: float, note: str | None = None) -> list[Label]:
    """The row of one grade: `value` in [0, 1] (good = 1, bad = 0). LabelError names what is wrong."""
    reviewer, note = _checked(reviewer, note)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 <= value <= 1:
        raise LabelError(f"value: a grade is a number in [0, 1] (good 1, bad 0), got {value!r}")
    sid = new_submission_id()
    return [Label(f"{sid}-0", sid, workspace_id, reviewer, "grade", episode.rollout_id, episode.batch_id,
                  episode.group_id, float(value), None, None, note, now())]


def ordering(workspace_id: str, reviewer: str, episodes: list[EpisodeKey], note: str | None = None) -> list[Label]:
    """The rows of one ordering of a group, best first: rank k of n has the value (n - k) / (n - 1), so the best
    is 1 and the worst 0, whatever n. At least two distinct episodes of one group. LabelError names what is wrong."""
    reviewer, note = _checked(reviewer, note)
    ids = [e.rollout_id for e in episodes]
    if len(ids) < 2 or len(set(ids)) != len(ids):
        raise LabelError(f"order: at least two distinct episodes of one group, best first, got {ids}")
    groups = sorted({(e.batch_id, e.group_id) for e in episodes})
    if len(groups) > 1:
        raise LabelError(f"order: every episode must be of one group; these are of {len(groups)}: "
                         f"{', '.join(f'{b}/{g}' for b, g in groups)}")
    sid, n, at = new_submission_id(), len(episodes), now()
    return [Label(f"{sid}-{k}", sid, workspace_id, reviewer, "order", e.rollout_id, e.batch_id, e.group_id,
                  (n - 1 - k) / (n - 1), k + 1, n, note, at) for k, e in enumerate(episodes)]


def append_labels(ws: Workspace, rows: list[Label]) -> str:
    """Write one submission's rows as one Parquet file, then register it in the catalog as a complete `labels`
    artifact (one transaction); returns its id. The catalog call waits its turn if another process (a running
    pipeline) is inside one (storage/catalog.py), so a label is never lost to a busy catalog."""
    submissions = {r.submission_id for r in rows}
    if len(submissions) != 1:
        raise ValueError(f"one submission per call, got {sorted(submissions)}")
    sid = submissions.pop()
    meta = {"reviewer": rows[0].reviewer, "kind": rows[0].kind, "rollouts": [r.rollout_id for r in rows]}
    batches = sorted({r.batch_id for r in rows})
    ws.write_artifacts("labels", "review", [(sid, to_table(rows, Label), batches, config_hash(meta), meta)])
    return sid


def label_values(ws: Workspace) -> dict[str, dict[str, float]]:
    """rollout id -> reviewer -> the value the reviewer's current labels give it (the `label_values` view), over
    the whole workspace: what the `human` reward reads (rewards/human.py)."""
    out: dict[str, dict[str, float]] = {}
    for r in ws.query("SELECT rollout_id, reviewer, value FROM label_values ORDER BY rollout_id, reviewer").to_pylist():
        out.setdefault(r["rollout_id"], {})[r["reviewer"]] = r["value"]
    return out
