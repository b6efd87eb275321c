"""A new workspace's Prefect database is a copy of a migrated empty one (flows/prefect_db.py)."""

from __future__ import annotations

import sqlite3
from importlib.metadata import version

from flows.prefect_db import seed
from storage.settings import cache_dir


def _revision(db) -> list[tuple[str]]:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT version_num FROM alembic_version").fetchall()


def test_a_new_home_gets_the_migrated_template_and_a_database_already_there_is_kept(tmp_path, monkeypatch):
    monkeypatch.delenv("PREFECT_API_DATABASE_CONNECTION_URL", raising=False)
    monkeypatch.delenv("PREFECT_SERVER_DATABASE_CONNECTION_URL", raising=False)
    seed(tmp_path / "a")
    template = cache_dir() / "prefect" / f"empty-{version('prefect')}.db"
    db = tmp_path / "a" / "prefect.db"
    assert db.read_bytes() == template.read_bytes()
    assert len(_revision(db)) == 1  # migrated: alembic's revision is recorded
    with sqlite3.connect(db) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert {"flow", "flow_run", "task_run", "deployment"} <= tables
        assert conn.execute("SELECT count(*) FROM flow_run").fetchone() == (0,)

    with sqlite3.connect(db) as conn:  # a used database
        conn.execute("CREATE TABLE mine (x)")
    made = template.stat().st_mtime_ns
    seed(tmp_path / "a")
    seed(tmp_path / "b")
    assert template.stat().st_mtime_ns == made  # made once per Prefect version
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'mine'").fetchone() == (1,)
    assert (tmp_path / "b" / "prefect.db").read_bytes() == template.read_bytes()


def test_a_configured_database_is_left_to_prefect(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_API_DATABASE_CONNECTION_URL", f"sqlite+aiosqlite:///{tmp_path / 'elsewhere.db'}")
    seed(tmp_path / "home")
    assert (tmp_path / "home").is_dir() and not (tmp_path / "home" / "prefect.db").exists()
