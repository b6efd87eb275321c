"""The deployment loop's night: the traffic since the last night, trained from the champion, gated without labels.

    night = open_night(ws, "nightly")                  # its window: since the last complete night, until now
    cfg = night_config(cfg, night, ws)                 # the traffic task reads exactly that window
    ... pipeline.train from start_policy(ws, cfg), the gate against the champion (flows/prefect_flows.py)
    close_night(ws, night, status="complete", ...)

A night's window is [the previous complete night's `until` (the beginning of the traffic for the first), the moment
the night opened). It is decided once and written to the catalog's `nights` table before any work: a night that is
killed and run again (the same command, a Prefect retry) reopens the same row, reads the same scenarios and finds
its artifacts done. A night with no train or no held-out scenario in its window is `skipped`, and the next night's
window starts where the last complete one ended, so skipped traffic is not lost.

The loop trains from the serving champion (the registered model's `champion` alias), not from the run's newest
checkpoint: a challenger the gate held back is not where the next night starts. Before the first champion it starts
from the base model, and the gate compares the challenger with that base (what `rlops serve --fallback base` served).
`rlops run` on a traffic config closes its window the same way (`pinned`): a resumed run keeps the one it began with.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from storage.schema import now

if TYPE_CHECKING:
    from flows.run_config import RunConfig
    from storage.workspace import Workspace

OPEN = ("running", "failed")  # a night in one of these is reopened by the next call, with its window


def open_night(ws: Workspace, run_name: str, at: datetime | None = None) -> dict[str, Any]:
    """The run's night to work on: its unfinished one (reopened, same window), else a new one from the end of the
    last complete night to `at` (default now), recorded `running` before anything else happens."""
    nights = ws.catalog.rows("SELECT * FROM nights WHERE run_name = ? ORDER BY started_at", [run_name])
    if nights and nights[-1]["status"] in OPEN:
        night = nights[-1]
        _write(ws, {**night, "status": "running", "error": None})
        return {**night, "status": "running"}
    done = [n for n in nights if n["status"] == "complete"]
    night = {"night_id": f"nt-{uuid.uuid4().hex[:12]}", "run_name": run_name, "since": done[-1]["until"] if done else None,
             "until": at or now(), "status": "running", "started_at": now()}
    _write(ws, night)
    return night


def close_night(ws: Workspace, night: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """Record how the night ended (`status`: complete | skipped | failed, and what it made); returns the row."""
    row = {**night, **fields, "finished_at": now()}
    row["seconds"] = (row["finished_at"] - _utc(row["started_at"])).total_seconds()
    _write(ws, row)
    return row


COLUMNS = ("night_id", "run_name", "since", "until", "status", "calls", "scenarios_train", "scenarios_heldout",
           "start_policy", "final_policy", "promotion_id", "promoted", "mlflow_run_id", "prefect_flow_run_id",
           "started_at", "finished_at", "seconds", "error")


def _write(ws: Workspace, row: dict[str, Any]) -> None:
    ws.catalog.write(["nights"], [(f"INSERT OR REPLACE INTO nights VALUES ({', '.join('?' * len(COLUMNS))})",
                                   [row.get(c) for c in COLUMNS])])


def _utc(t: datetime) -> datetime:
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def night_config(cfg: RunConfig, night: dict[str, Any], ws: Workspace) -> RunConfig:
    """`cfg` with its traffic task reading the night's window of this workspace's traffic."""
    since = night["since"]
    params = {**cfg.task.params, "workspace": str(ws.root), "since": _utc(since).isoformat() if since else None,
              "until": _utc(night["until"]).isoformat()}
    return cfg.model_copy(update={"task": cfg.task.model_copy(update={"params": params})})


def window_calls(ws: Workspace, night: dict[str, Any]) -> int:
    """How many calls were served in the night's window (all of them, before the task's filter)."""
    return ws.query("SELECT count(*) AS n FROM traffic WHERE ($since IS NULL OR served_at >= $since) "
                    "AND served_at < $until", {"since": night["since"], "until": night["until"]}).to_pylist()[0]["n"]


def start_policy(ws: Workspace, cfg: RunConfig) -> tuple[str | None, int]:
    """(policy id, step) of the serving champion of the run's registered model, where a night trains from; (None, 0)
    before the first champion (the night starts from the base model)."""
    from flows.promotion import champion_of
    from storage.registry import Registry

    try:
        champion = champion_of(Registry(ws.tracker.client), cfg.gate_config.model_name or cfg.name)
    except KeyError:  # no registered model yet: no night was ever promoted
        return None, 0
    if champion is None:
        return None, 0
    return champion.policy_id, int(ws.catalog.get_checkpoint(champion.policy_id)["step"] or 0)


def trace_night(ws: Workspace, night: dict[str, Any], batches: list[str], run_id: str) -> int:
    """The night's episodes as MLflow traces on its run (storage/traces.py): every served episode of its window and
    every episode it trained on; returns how many were made (a resumed night adds only the missing ones)."""
    from storage.schema import Rollout, from_table
    from storage.traces import trace_rollouts, trace_served

    served = ws.query("SELECT * FROM traffic WHERE ($since IS NULL OR served_at >= $since) AND served_at < $until",
                      {"since": night["since"], "until": night["until"]}).to_pylist()
    trained = from_table(ws.query("SELECT * FROM rollouts WHERE list_contains($b, batch_id)", {"b": batches}), Rollout)
    return len(trace_served(ws, served, run_id)) + len(trace_rollouts(ws, trained, run_id))


def pinned(ws: Workspace, cfg: RunConfig) -> RunConfig:
    """A traffic run's config with its window closed (`tasks.traffic.closed`): at now, or where the run's unfinished
    attempt closed it, so a resumed `rlops run` reads the scenarios it began with. Other configs are returned as is."""
    if cfg.task.name != "traffic":
        return cfg
    from tasks.traffic import closed

    previous = ws.catalog.get_run(cfg.name)
    until = now()
    if previous and previous["status"] != "complete":
        began = ((previous["config"] or {}).get("task") or {}).get("params", {}).get("until")
        until = datetime.fromisoformat(began) if began else until
    params = closed(cfg.task.params, until)
    return cfg.model_copy(update={"task": cfg.task.model_copy(update={"params": params})})
