"""`rlops schedule`: serve a Prefect deployment that retrains on a cron schedule.

Prefect runs schedules only through a real server (`prefect server start`); the ephemeral server
that `rlops run` starts on its own has no scheduler. So this command insists on `PREFECT_API_URL`
pointing at a reachable server and says how to get one otherwise. Each scheduled run re-reads
the config file, continues the run's lineage from its latest checkpoint, and gates its final
checkpoint against the serving champion (flows/promotion.py, docs/PROMOTION.md).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from flows.run_config import RunConfig

NO_SERVER = (
    "error: rlops schedule needs a running Prefect server (schedules are run by its scheduler).\n"
    "  start one:  prefect server start --host 127.0.0.1 --port 4200\n"
    "  then:       export PREFECT_API_URL=http://127.0.0.1:4200/api"
)


def server_problem() -> str | None:
    """None if PREFECT_API_URL names a healthy server, else the message to print."""
    import httpx

    url = os.environ.get("PREFECT_API_URL")
    if not url:
        return NO_SERVER + "\n  (PREFECT_API_URL is not set)"
    try:
        response = httpx.get(url.rstrip("/") + "/health", timeout=5.0)
        response.raise_for_status()
    except httpx.HTTPError as e:
        return NO_SERVER + f"\n  (no healthy server at {url}: {type(e).__name__}: {e})"
    return None


def serve(cfg: RunConfig, config_path: Path, overrides: list[str], workspace: Path, cron: str,
          name: str | None = None) -> int:
    """Create the deployment with the cron schedule and serve it (blocks until interrupted)."""
    from prefect.client.schemas.schedules import CronSchedule

    try:
        CronSchedule(cron=cron)
    except ValueError as e:
        print(f"error: invalid cron expression {cron!r}: {e}", file=sys.stderr)
        return 2
    problem = server_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    from flows.prefect_flows import scheduled_train_flow

    deployment = name or cfg.name
    print(f"serving deployment rlops-scheduled-train/{deployment} on cron {cron!r} "
          f"(workspace {workspace}); Ctrl-C stops serving", flush=True)
    scheduled_train_flow.serve(
        name=deployment,
        cron=cron,
        parameters={"config_path": str(config_path), "workspace": str(workspace), "overrides": list(overrides)},
        tags=["rlops", cfg.name],
        pause_on_shutdown=False,  # a restarted server process keeps the schedule
        print_starting_message=False,
    )
    return 0
