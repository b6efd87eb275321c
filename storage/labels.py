"""People's labels of episodes: append-only rows in the workspace, and what they say, as SQL.

    sid = append_labels(ws, [Label(...), ...])     # one submission: a grade, or an ordering of a group
    values = label_values(ws)                      # rollout id -> reviewer -> value, from the current labels

A submission (one grade, or one ordering of a group) is one Parquet file written atomically and registered in
the catalog as one complete `labels` artifact, in that order: a label is visible whole or not at all, and never
overwritten. A later submission by the same reviewer on the same episode (a grade) or group (an ordering)
supersedes the earlier one, which stays in the table. The views, built by `storage.sql.open_views`:

    labels                  every row ever written, with `current`: the reviewer's latest on its episode (a grade)
                            or its group (an ordering)
    label_values            one value per (reviewer, episode) from the current labels: where the reviewer ordered
                            the episode's group, its place in the ordering, (n - rank) / (n - 1); else its grade
    label_pairs             the preferences those values express: within one group and one reviewer, `preferred`
                            has the higher value (ties express none)
    label_agreement_groups  per reward name@version, reviewer and group: the reviewer's pairs the reward orders the
                            same way (concordant), the other way (discordant) or not at all (ties), and for an
                            ordered group Kendall's tau-b between the ordering and the reward
    label_agreement         the same per reward name@version over the workspace: pairwise accuracy (ties count half)
                            and the mean tau (flows/views/agreement.py adds intervals, per run)
    reviewer_agreement_groups  per (reviewer_a, reviewer_b, group): reviewer_b's values judged against reviewer_a's
                            pairs, as a reward is
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

# Which rows are current: the latest submission of a reviewer on an episode (grades) or a group (orderings).
LABELS_VIEW = """
SELECT *, submission_id = first_value(submission_id) OVER (
    PARTITION BY reviewer, kind, CASE WHEN kind = 'grade' THEN rollout_id ELSE batch_id || chr(0) || group_id END
    ORDER BY created_at DESC, submission_id DESC) AS current
FROM _labels_rows
"""

# A reviewer's ordering of a group decides the values of that group's episodes, whatever they graded there: an
# ordering is the relative judgement GRPO and DPO use, and mixing its ranks with grades would compare two scales.
LABEL_VALUES_VIEW = """
WITH cur AS (SELECT * FROM labels WHERE current)
SELECT reviewer, rollout_id, batch_id, group_id, kind, value, rank, created_at FROM cur WHERE kind = 'order'
UNION ALL
SELECT g.reviewer, g.rollout_id, g.batch_id, g.group_id, g.kind, g.value, g.rank, g.created_at FROM cur g
WHERE g.kind = 'grade' AND NOT EXISTS (SELECT 1 FROM cur o WHERE o.kind = 'order' AND o.reviewer = g.reviewer
                                       AND o.batch_id = g.batch_id AND o.group_id = g.group_id)
"""

LABEL_PAIRS_VIEW = """
SELECT a.reviewer, a.batch_id, a.group_id, a.kind, a.rollout_id AS preferred, b.rollout_id AS other,
       a.value - b.value AS margin
FROM label_values a JOIN label_values b USING (reviewer, batch_id, group_id)
WHERE a.value > b.value
"""

# Per group: C concordant, D discordant, T tied pairs out of n. Kendall's tau-b of an ordering (no ties on the
# person's side) against the judge's values is (C - D) / sqrt(n * (n - T)); undefined when the judge ties them all.
_COUNTS = """count(*) AS pairs, count(*) FILTER (WHERE s > 0) AS concordant, count(*) FILTER (WHERE s < 0) AS discordant,
       count(*) FILTER (WHERE s = 0) AS ties,
       CASE WHEN any_value(kind) = 'order' AND count(*) FILTER (WHERE s <> 0) > 0
            THEN (count(*) FILTER (WHERE s > 0) - count(*) FILTER (WHERE s < 0))
                 / sqrt(count(*) * count(*) FILTER (WHERE s <> 0)) END AS kendall_tau"""

# Each rollout's newest row of each reward version (a forced rescore writes a version twice); errors left out.
LABEL_AGREEMENT_GROUPS_VIEW = f"""
WITH scores AS (
    SELECT rollout_id, reward_name, reward_version, value FROM rewards
    QUALIFY row_number() OVER (PARTITION BY rollout_id, reward_name, reward_version ORDER BY scored_at DESC) = 1),
judged AS (
    SELECT p.reviewer, p.batch_id, p.group_id, p.kind, x.reward_name, x.reward_version, sign(x.value - y.value) AS s
    FROM label_pairs p JOIN scores x ON x.rollout_id = p.preferred
    JOIN scores y ON y.rollout_id = p.other AND y.reward_name = x.reward_name AND y.reward_version = x.reward_version
    WHERE x.value IS NOT NULL AND y.value IS NOT NULL)
SELECT reward_name, reward_version, reviewer, batch_id, group_id, any_value(kind) AS kind,
       {_COUNTS}
FROM judged GROUP BY reward_name, reward_version, reviewer, batch_id, group_id
"""

LABEL_AGREEMENT_VIEW = """
SELECT reward_name, reward_version, count(DISTINCT (batch_id, group_id)) AS groups, sum(pairs) AS pairs,
       sum(concordant) AS concordant, sum(discordant) AS discordant, sum(ties) AS ties,
       (sum(concordant) + sum(ties) / 2) / sum(pairs) AS pairwise_accuracy,
       count(kendall_tau) AS ranked_groups, avg(kendall_tau) AS mean_kendall_tau
FROM label_agreement_groups GROUP BY reward_name, reward_version
"""

REVIEWER_AGREEMENT_GROUPS_VIEW = f"""
WITH judged AS (
    SELECT p.reviewer AS reviewer_a, x.reviewer AS reviewer_b, p.batch_id, p.group_id, p.kind, sign(x.value - y.value) AS s
    FROM label_pairs p JOIN label_values x ON x.rollout_id = p.preferred AND x.reviewer <> p.reviewer
    JOIN label_values y ON y.rollout_id = p.other AND y.reviewer = x.reviewer)
SELECT reviewer_a, reviewer_b, batch_id, group_id, any_value(kind) AS kind,
       {_COUNTS}
FROM judged GROUP BY reviewer_a, reviewer_b, batch_id, group_id
"""

# name -> SQL, created in this order over the `_labels_rows` view of the registered files (storage.sql.open_views).
VIEWS = {"labels": LABELS_VIEW, "label_values": LABEL_VALUES_VIEW, "label_pairs": LABEL_PAIRS_VIEW,
         "label_agreement_groups": LABEL_AGREEMENT_GROUPS_VIEW, "label_agreement": LABEL_AGREEMENT_VIEW,
         "reviewer_agreement_groups": REVIEWER_AGREEMENT_GROUPS_VIEW}


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
