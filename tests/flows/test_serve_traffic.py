"""`rlops serve` keeping its traffic, as a process: calls flushed in parts every N calls, readable with `rlops sql`
while it serves, feedback taken; SIGKILLed, it leaves whole files and loses at most the calls not yet flushed.
Then `--record off` keeps nothing, and a fraction keeps whole episodes by a stable hash."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import httpx
import openai
import pyarrow.parquet as pq
import pytest

from flows.serve_commands import record_fraction
from storage.traffic import recorded
from tests.flows.conftest import rlops_here
from tests.processes import free_port, start_run, wait_until

pytestmark = pytest.mark.slow  # a `rlops serve` process on the tiny model


def answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/models", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def count(capsys, ws: Path, table: str) -> int:
    out = rlops_here(capsys, "sql", f"SELECT count(*) AS n FROM {table}", "--format", "json", "--workspace", str(ws))
    return json.loads(out.splitlines()[0])["n"]


def test_a_killed_server_leaves_whole_files_and_loses_at_most_what_it_had_not_flushed(tmp_path, tiny_model_dir,
                                                                                         capsys):
    ws, port, log = tmp_path / "ws", free_port(), tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    proc = start_run([sys.executable, "-m", "flows.cli", "serve", "--policy", "base", "--base-model", str(tiny_model_dir),
                      "--port", str(port), "--batch-window", "0", "--flush-calls", "2", "--flush-seconds", "3600",
                      "--workspace", str(ws)], log)
    try:
        wait_until(lambda: answers(url), proc, "rlops serve answered", timeout=300, every=0.2, log=log)
        for i in range(5):
            client = openai.OpenAI(base_url=f"{url}/ep/ep-{i}/v1", api_key="unused", max_retries=0,
                                   default_headers={"X-User-Id": f"u{i % 2}"})
            client.chat.completions.create(model="base", max_tokens=2, messages=[{"role": "user", "content": f"Hi {i}"}])
        # Two parts of two calls each are written while it serves; the fifth call waits for a sixth.
        wait_until(lambda: count(capsys, ws, "traffic") == 4, proc, "four calls in SQL", timeout=180, every=0.2, log=log)
        ok = httpx.post(f"{url}/rlops/episodes/ep-0/feedback", json={"score": 1, "who": "u0"})
        assert ok.status_code == 200, ok.text
        assert httpx.post(f"{url}/rlops/episodes/ep-9/feedback", json={"score": 1}).status_code == 404
        assert count(capsys, ws, "feedback") == 1
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert count(capsys, ws, "traffic") == 4  # the unflushed fifth call is the only loss
    files = sorted((ws / "data").rglob("*"))
    parquet = [f for f in files if f.is_file() and f.suffix == ".parquet"]
    assert parquet and all(pq.read_table(f).num_rows > 0 for f in parquet)  # every file whole
    assert not [f for f in files if f.name.endswith(".tmp")]
    rows = json.loads("[" + ",".join(rlops_here(capsys, "sql", "SELECT episode_id, user_id, policy_id FROM traffic "
                                                "ORDER BY served_at", "--format", "json", "--workspace",
                                                str(ws)).splitlines()) + "]")
    assert [r["episode_id"] for r in rows] == [f"ep-{i}" for i in range(4)] and rows[1]["user_id"] == "u1"
    assert all(r["policy_id"].startswith("base-") for r in rows)  # the base model's fingerprinted policy id
    assert "keeping all of the traffic" in log.read_text()


def test_record_off_all_or_a_fraction_of_the_episodes():
    assert (record_fraction("off"), record_fraction("all"), record_fraction("0.25")) == (0.0, 1.0, 0.25)
    for bad in ("some", "0", "1.5"):
        with pytest.raises(ValueError, match="--record"):
            record_fraction(bad)
    kept = {e for e in (f"ep-{i}" for i in range(1000)) if recorded(e, 0.25)}
    assert 200 < len(kept) < 300 and kept == {e for e in (f"ep-{i}" for i in range(1000)) if recorded(e, 0.25)}
