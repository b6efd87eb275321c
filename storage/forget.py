"""Forgetting a person: their traffic, feedback and everything re-sampled from their scenarios leave the workspace's
files (the bytes: Parquet rewritten without them), and what was trained on them is listed.

    report = forget(ws, "user", "alice")     # or "session", "episode"; `rlops traffic forget --user alice`

What goes, found from the person's `traffic` rows (their calls):
- `traffic`: their calls; `feedback`: the feedback on their episodes;
- `rollouts` of the traffic task whose prompt is one of their scenarios (`scenario_id`, or an agent's `input_id`: the
  same question asked by someone else is theirs too, and goes), with the gate's greedy answers to it; `rewards` and
  people's `labels` of those rollouts; `verdicts` on those scenarios;
- MLflow traces of their episodes and of those rollouts (storage/traces.py), SQLite vacuumed so no page keeps them;
- judge-cache entries whose text holds one of their messages (a judge's explanation may quote them).

Each data file holding such rows is rewritten without them (temp file, fsync, rename) or deleted when nothing is left,
and the catalog's `files` and `artifacts` rows follow in one transaction. All of it happens under the catalog's lock,
which every traffic writer takes (storage/traffic.py), so no flush or merge interleaves. Checkpoints keep their
weights: the report lists every checkpoint trained on those rollouts and those below it (the `traffic_lineage`
view), with its registered versions, for a person to retrain or delete. The `forgotten` table records the event with
the subject as a sha256 and the counts, never the id. Calls a running server has not flushed yet are not in the
files: forget again after its next flush (or stop it first).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from storage.atomic import atomic_file
from storage.parquet import FileInfo
from storage.schema import now

if TYPE_CHECKING:
    from storage.workspace import Workspace

SCOPES = {"user": "user_id", "session": "session_id", "episode": "episode_id"}


def forget(ws: Workspace, scope: str, subject: str) -> dict[str, Any]:
    """Remove a user's, session's or episode's data (module docstring); returns the `forgotten` row written, with the
    checkpoints trained on it (`checkpoints`: policy_id, run_name, step, how, registered)."""
    if scope not in SCOPES:
        raise ValueError(f"forget: a user, session or episode, got {scope!r}")
    if not ws.data.local:
        raise ValueError(f"forget rewrites the data files in place; {ws.data.root} is object storage (not supported yet)")
    from storage.traffic import remove_orphans

    with ws.catalog.connect():  # the lock every traffic writer takes: nothing is flushed or merged meanwhile
        remove_orphans(ws)  # a killed flush's or merge's unregistered copy may hold their calls too
        calls = ws.query(f"SELECT episode_id, scenario_id, input_id, messages FROM traffic WHERE {SCOPES[scope]} = ?",
                         [subject]).to_pylist()
        if not calls:
            raise KeyError(f"no traffic of {scope} {subject!r} in this workspace")
        episodes = sorted({c["episode_id"] for c in calls if c["episode_id"]})
        scenarios = sorted({k for c in calls for k in (c["scenario_id"], c["input_id"]) if k})
        texts = {m["content"] for c in calls for m in c["messages"] if m["role"] == "user" and len(m["content"] or "") >= 8}
        rollouts = [r["rollout_id"] for r in ws.query(
            "SELECT rollout_id FROM rollouts WHERE task = 'traffic' AND list_contains(?, prompt_id)", [scenarios]).to_pylist()]
        checkpoints = _trained_on(ws, scope, subject)
        counts, files = {}, 0
        for name, kind, column, values in [
            ("traffic_rows", "traffic", SCOPES[scope], [subject]), ("feedback_rows", "feedback", "episode_id", episodes),
            ("rollout_rows", "rollouts", "rollout_id", rollouts), ("reward_rows", "rewards", "rollout_id", rollouts),
            ("verdict_rows", "verdicts", "prompt_id", scenarios), ("label_rows", "labels", "rollout_id", rollouts),
        ]:
            counts[name], touched = _drop(ws, kind, column, values)
            files += touched
        counts.pop("label_rows")
        _forget_traces(ws, scope, subject, episodes, scenarios)
        _forget_judge_cache(ws, texts)
        row = {"forget_id": f"fg-{uuid.uuid4().hex[:16]}", "scope": scope,
               "subject_sha256": hashlib.sha256(subject.encode()).hexdigest(), **counts, "files_rewritten": files,
               "scenarios": json.dumps(scenarios), "checkpoints": json.dumps(checkpoints), "forgotten_at": now()}
        columns = list(row)
        ws.catalog.write(["forgotten"], [(f"INSERT INTO forgotten ({', '.join(columns)}) VALUES "
                                          f"({', '.join('?' * len(columns))})", [row[c] for c in columns])])
    return {**row, "scenarios": scenarios, "checkpoints": checkpoints}


def _drop(ws: Workspace, kind: str, column: str, values: list[str]) -> tuple[int, int]:
    """Rewrite every registered file of `kind` holding rows whose `column` is one of `values` without them (deleting a
    file left empty), then update the catalog in one transaction; returns (rows removed, files rewritten or deleted).
    Which files hold such rows is asked of DuckDB first, which reads that one column (and skips row groups by their
    statistics): only those files are read whole and rewritten."""
    paths = [r["path"] for r in ws.catalog.rows("SELECT path FROM files WHERE kind = ?", [kind])]
    if not values or not paths:
        return 0, 0
    hit_paths = [p for (p,) in duckdb.execute(
        f'SELECT DISTINCT filename FROM read_parquet(?, filename = true, union_by_name = true) '
        f'WHERE list_contains(?, "{column}")', [paths, values]).fetchall()]
    changed: dict[str, FileInfo] = {}
    dropped: list[str] = []
    removed = 0
    wanted = pa.array(values, pa.string())
    for path in hit_paths:
        table = ws.data.read([path])
        hit = pc.fill_null(pc.is_in(table[column], value_set=wanted), False)
        removed += pc.sum(hit).as_py() or 0
        kept = table.filter(pc.invert(hit))
        if kept.num_rows:
            changed[path] = _rewrite(ws, path, kept)
        else:
            ws.data.delete(path)
            dropped.append(path)
    if changed or dropped:
        ws.catalog.update_files(changed, dropped)
    return removed, len(changed) + len(dropped)


def _rewrite(ws: Workspace, path: str, table: pa.Table) -> FileInfo:
    """`table` written over the local file `path` (temp, fsync, rename: whole or not at all)."""
    import pyarrow.parquet as pq

    with atomic_file(path) as f:
        pq.write_table(table, f, compression="zstd")
    return FileInfo(path, table.num_rows, Path(path).stat().st_size)


def _trained_on(ws: Workspace, scope: str, subject: str) -> list[dict[str, Any]]:
    """Every checkpoint trained on the subject's scenarios or below one that was, with its registered versions."""
    rows = ws.query(f"SELECT policy_id, any_value(run_name) AS run_name, any_value(step) AS step, min(how) AS how "
                    f"FROM traffic_lineage WHERE {SCOPES[scope]} = ? GROUP BY policy_id ORDER BY step", [subject]).to_pylist()
    if not rows:
        return []
    versions = _registered(ws, [r["policy_id"] for r in rows])
    return [{**r, "registered": ", ".join(versions.get(r["policy_id"], [])) or None} for r in rows]


def _registered(ws: Workspace, policies: list[str]) -> dict[str, list[str]]:
    """policy id -> its registered versions as NAME/VERSION (with aliases), from MLflow's registry."""
    from storage.registry import POLICY_TAG, Registry

    registry = Registry.reader(ws.settings)
    out: dict[str, list[str]] = {}
    if registry is None:
        return out
    for policy in policies:
        for v in registry.client.search_model_versions(f"tags.`{POLICY_TAG}` = '{policy}'"):
            aliases = f" @{','.join(v.aliases)}" if v.aliases else ""
            out.setdefault(policy, []).append(f"{v.name}/{v.version}{aliases}")
    return out


def _forget_traces(ws: Workspace, scope: str, subject: str, episodes: list[str], scenarios: list[str]) -> int:
    """Delete the MLflow traces of the subject's episodes and of the rollouts re-sampled from their scenarios."""
    from storage.registry import Registry
    from storage.traces import delete_traces, search, user_digest

    if Registry.reader(ws.settings) is None:  # no MLflow database: nothing was traced
        return 0
    found = search(ws, {"rlops.user_sha256": user_digest(subject)}) if scope == "user" else []
    wanted = set(episodes) | set(scenarios)
    found += [t for kind in ("served", "trained") for t in search(ws, {"rlops.kind": kind})
              if t.info.tags.get("rlops.episode_id") in wanted or t.info.tags.get("rlops.scenario_id") in wanted]
    return delete_traces(ws, sorted({t.info.trace_id for t in found}))


def _forget_judge_cache(ws: Workspace, texts: set[str]) -> int:
    """Delete the judge's cached verdicts whose text holds one of the subject's messages."""
    removed = 0
    for path in ws.judge_cache_dir.rglob("*.json") if ws.judge_cache_dir.is_dir() and texts else []:
        body = path.read_text(errors="replace")
        if any(t in body or json.dumps(t)[1:-1] in body for t in texts):
            path.unlink()
            removed += 1
    return removed
