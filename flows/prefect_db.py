"""A new workspace's Prefect database: a copy of a migrated empty one, not migrated again.

`rlops run` keeps Prefect's state in the workspace (`PREFECT_HOME=<workspace>/prefect`) and starts a
temporary Prefect server on it. On a new workspace that server first runs every one of Prefect's
migrations; measured on 2 cores, a run's temporary server took 13.9 s of CPU migrating its database and
9.3 s starting from a migrated copy. So rlops keeps one migrated, empty database per Prefect version in
its cache (`$RLOPS_CACHE/prefect/empty-<version>.db`, made once by `prefect server database upgrade`)
and copies it into each new workspace; the server finds it at its current revision, as it would its
own after a first run. storage.tracking does the same for MLflow's database.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from importlib.metadata import version
from pathlib import Path

from storage.atomic import copy_if_absent


def _template() -> Path | None:
    """The migrated empty database for the installed Prefect, made on first use; None if it cannot be made
    (the server then migrates its own database, as it would without this)."""
    from storage.settings import cache_dir

    template = cache_dir() / "prefect" / f"empty-{version('prefect')}.db"
    if template.exists():
        return template
    template.parent.mkdir(parents=True, exist_ok=True)
    made = template.with_name(f".{template.name}.{uuid.uuid4().hex[:8]}.tmp")
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "PREFECT_HOME": home, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{made}"}
        env.pop("PREFECT_API_URL", None)
        out = subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"], env=env,
                             capture_output=True, text=True, timeout=600)
    if out.returncode != 0 or not made.exists():
        made.unlink(missing_ok=True)
        return None
    os.replace(made, template)  # whole or absent; two makers at once each replace it with a whole copy
    return template


def seed(home: Path) -> None:
    """Give the Prefect home `home` a migrated empty `prefect.db` unless it has a database already or
    Prefect is configured to use another one (`home` is made if missing). Linked into place, so a database
    made meanwhile is kept."""
    home.mkdir(parents=True, exist_ok=True)
    if os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL") or os.environ.get("PREFECT_SERVER_DATABASE_CONNECTION_URL"):
        return
    copy_template(home / "prefect.db")


def copy_template(db: Path) -> None:
    """Put a copy of the migrated empty database at `db` unless a file is there already (or no template can
    be made); for a server whose database URL names `db`."""
    if db.exists():
        return
    template = _template()
    if template is not None:
        copy_if_absent(template, db)
