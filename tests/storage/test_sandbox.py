"""`rlops sql`'s sandbox: refuses every write or escape, leaves the data unchanged."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from storage.sql import RefusedStatement, Sandbox
from tests.storage.conftest import add_batch

REFUSED_BY_TYPE = [
    "CREATE TABLE t AS SELECT 1",
    "INSERT INTO checkpoints (policy_id) VALUES ('x')",
    "UPDATE checkpoints SET kind = 'x'",
    "DELETE FROM runs",
    "DROP VIEW rollouts",
    "COPY (SELECT * FROM rollouts) TO '/tmp/leak.csv'",
    "EXPORT DATABASE '/tmp/leak'",
    "ATTACH '/tmp/other.duckdb' AS o",
    "INSTALL httpfs",
    "LOAD httpfs",
    "SET enable_external_access = true",
    "SET lock_configuration = false",
    "PRAGMA enable_profiling",
    "CALL pragma_version()",
    "SELECT 1; DROP TABLE runs",  # a refused statement anywhere refuses the whole script, before running any
]


def _fingerprint(root: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def filled(ws):
    add_batch(ws, "ro-a")
    return ws


@pytest.mark.parametrize("sql", REFUSED_BY_TYPE)
def test_sandbox_refuses_writes_and_escapes(filled, sql):
    before = _fingerprint(filled.root)
    sandbox = Sandbox(filled.settings)
    with pytest.raises(RefusedStatement, match="refused"):
        sandbox.query(sql)
    assert sandbox.query("SELECT count(*) AS n FROM rollouts").to_pylist() == [{"n": 8}]
    assert sandbox.query("SELECT count(*) AS n FROM runs").to_pylist() == [{"n": 0}]
    assert _fingerprint(filled.root) == before
    assert not Path("/tmp/leak.csv").exists()


@pytest.mark.parametrize(
    "fn", ["read_csv", "read_text", "read_parquet", "read_json", "read_blob", "glob"]
)
def test_sandbox_blocks_files_outside_the_data_root(filled, tmp_path, fn):
    secret = tmp_path / "secret.txt"
    secret.write_text("a,b\n1,2\n")
    sandbox = Sandbox(filled.settings)
    for path in [str(secret), "/etc/passwd", f"{filled.settings.data_root}/../catalog.duckdb",
                 str(filled.settings.snapshot_dir / "runs.parquet")]:
        with pytest.raises(Exception, match="(?i)permission|access|disabled"):
            sandbox.query(f"SELECT * FROM {fn}('{path}')")


def test_sandbox_cannot_lift_the_lockdown_through_functions(filled):
    sandbox = Sandbox(filled.settings)
    with pytest.raises(Exception):
        sandbox.query("SELECT set_config('enable_external_access', 'true')")  # no such escape hatch
    assert sandbox.query("SELECT current_setting('enable_external_access') AS v").to_pylist() == [{"v": False}]


def test_sandbox_times_out_long_queries(filled):
    from storage.sql import QueryTimeout

    sandbox = Sandbox(filled.settings, timeout_s=0.5)
    with pytest.raises(QueryTimeout):
        sandbox.query("SELECT count(*) FROM range(100000000000) a")


def test_rlops_sql_works_while_another_process_holds_the_catalog_for_writing(filled):
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import duckdb, sys, time
            con = duckdb.connect({str(filled.settings.catalog_path)!r})  # read-write: takes the file lock
            con.execute("INSERT INTO runs (run_name, status) VALUES ('held', 'running')")
            print("holding", flush=True)
            time.sleep(60)
        """)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        out = subprocess.run(
            [sys.executable, "-m", "flows.cli", "sql", "--workspace", str(filled.root), "--format", "csv",
             "SELECT count(*) AS n FROM rollouts JOIN rewards USING (rollout_id)"],
            capture_output=True, timeout=60, env={**os.environ},
        )
        assert out.returncode == 0, out.stderr.decode()
        assert out.stdout == b"n\n8\n"  # bytes: lines end with \n, so $(rlops sql ... | tail -1) has no \r
    finally:
        holder.kill()
        holder.wait()


def test_cli_exit_codes_for_bad_and_refused_sql(filled):
    def run(sql: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "flows.cli", "sql", "--workspace", str(filled.root), sql],
                              capture_output=True, text=True, timeout=60)

    bad = run("SELEC 1")
    assert bad.returncode == 1 and "syntax error" in bad.stderr
    refused = run("DELETE FROM runs")
    assert refused.returncode == 2 and "refused" in refused.stderr
    missing = run("SELECT * FROM no_such_table")
    assert missing.returncode == 1 and "no_such_table" in missing.stderr


def test_csv_output_ends_lines_with_newline_and_quotes_cells():
    from flows.registry import print_rows

    out = io.StringIO()
    print_rows(["id", "note"], [["b1", "a, b"], ["b2", None]], fmt="csv", out=out)
    assert out.getvalue() == 'id,note\nb1,"a, b"\nb2,\n'
