"""The data root on a real S3-compatible HTTP server on 127.0.0.1 (moto's server mode).

Endpoint and credentials come from the environment only (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...),
as a user would set them; the bucket exists beforehand (rlops never creates buckets).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from storage.workspace import Workspace
from tests.processes import free_port, kill, start_server, stop, wait_until
from tests.storage.conftest import add_batch

BUCKET = "rlops-test"


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[dict[str, str]]:
    """A moto S3 server on 127.0.0.1 with an empty bucket; the AWS variables point at it."""
    port = free_port()
    proc = start_server([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
                        f"http://127.0.0.1:{port}/", timeout=60)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "RLOPS_DATA_ROOT": f"s3://{BUCKET}/data"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    import boto3

    boto3.client("s3").create_bucket(Bucket=BUCKET)
    try:
        yield env
    finally:
        stop(proc)


def _keys(prefix: str = "") -> list[str]:
    import boto3

    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def _rows(out: subprocess.CompletedProcess) -> list[dict]:
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]  # one JSON object per row


def _sql(env: dict[str, str], workspace: Path, query: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", "sql", query, "--format", "json", "--workspace", str(workspace)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **env})


@pytest.mark.slow
def test_two_step_pipeline_on_s3_then_rlops_sql(s3, tmp_path, tiny_model_dir, monkeypatch):
    from flows import pipeline
    from flows.run_config import from_dict
    from stages.common import StageContext
    from tests.flows.conftest import expected_rows, tiny_config

    cfg = tiny_config(tiny_model_dir, name="s3", steps=2)
    monkeypatch.setenv("RLOPS_CACHE", str(tmp_path / "cache"))  # where checkpoints are downloaded to
    ws = Workspace.open(tmp_path / "ws")
    assert not ws.data.local
    result = pipeline.train(from_dict(cfg), StageContext(ws, run_name="s3"), on_step=lambda row: None)
    assert len(result.policies) == 2

    # Every Parquet file is in the bucket, none in the workspace folder; the catalog names them by s3:// URI.
    keys = _keys("data/")
    assert any(k.startswith("data/rollouts/") for k in keys) and any(k.startswith("data/rewards/") for k in keys)
    assert not list((tmp_path / "ws").rglob("*/rollouts/*.parquet"))
    paths = [f["path"] for f in ws.catalog.artifact_files(result.batches[0])]
    assert paths and all(p.startswith(f"s3://{BUCKET}/data/rollouts/") for p in paths)

    # Checkpoints too: each adapter is in the bucket (marker last) and was loaded from a downloaded copy.
    for policy in [result.sft, *result.policies]:
        uri = ws.catalog.get_checkpoint(policy)["adapter_uri"]
        assert uri == f"s3://{BUCKET}/data/checkpoints/{policy}"
        assert f"data/checkpoints/{policy}/_COMPLETE" in keys
        assert f"data/checkpoints/{policy}/adapter_model.safetensors" in keys
    for parent in [result.sft, result.policies[0]]:  # what step 2's rollout and GRPO loaded
        assert (tmp_path / "cache" / "checkpoints" / parent / "_COMPLETE").exists()

    expected = expected_rows(cfg)
    out = _sql(s3, tmp_path / "ws", "SELECT (SELECT count(*) FROM rollouts) AS rollouts, (SELECT count(*) FROM rewards) AS rewards")
    assert _rows(out) == [{"rollouts": expected["rollouts"], "rewards": expected["rewards"]}]
    joined = _sql(s3, tmp_path / "ws", "SELECT count(*) AS n FROM rollouts JOIN rewards USING (rollout_id) "
                                       "WHERE reward_name = 'correct'")
    assert _rows(joined) == [{"n": expected["rollouts"]}]

    # The sandbox holds: DuckDB itself reaches neither the bucket nor local files, and writes nothing.
    for query in (f"SELECT * FROM read_parquet('s3://{BUCKET}/{keys[0]}')",
                  f"SELECT * FROM read_parquet('{tmp_path}/ws/catalog/files.parquet')"):
        refused = _sql(s3, tmp_path / "ws", query)
        assert refused.returncode != 0 and ("disabled" in refused.stderr or "Permission" in refused.stderr), refused.stderr
    assert _sql(s3, tmp_path / "ws", "DROP VIEW rollouts").returncode == 2


WRITER = textwrap.dedent("""
    import sys
    import pyarrow as pa
    from storage.schema import to_table
    from storage.workspace import Workspace
    from tests.factories import tool_episode

    ws = Workspace.open(sys.argv[1])
    table = to_table([tool_episode("ro-big", g, s) for g in range(400) for s in range(8)])
    big = pa.concat_tables([table] * 40)  # ~130k rows: a multipart upload, long enough to be killed
    print("writing", flush=True)
    ws.write_part("rollouts", "ro-big", big, part="group-00000")
    ws.catalog.complete_artifact("ro-big", "rollouts", "rollout", [], "cfg")
    print("done", flush=True)
""")


def test_killed_write_leaves_nothing_visible_on_s3(s3, tmp_path):
    import boto3

    ws = Workspace.open(tmp_path / "ws")
    add_batch(ws, "ro-a")
    files_before = ws.query("SELECT * FROM files ORDER BY path").to_pylist()
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(ws.root)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ})
    assert proc.stdout.readline().strip() == "writing"
    client = boto3.client("s3")
    wait_until(lambda: client.list_multipart_uploads(Bucket=BUCKET).get("Uploads"), proc,  # parts are being uploaded
               "parts were uploaded (it finished before it could be killed)", timeout=120, every=0.005)
    kill(proc, group=False)

    # An upload never completed is no object (pyarrow's empty "folder/" marker is not a file).
    assert [k for k in _keys("data/rollouts/ro-big/") if not k.endswith("/")] == []
    assert ws.catalog.get_artifact("ro-big") is None
    assert ws.query("SELECT * FROM files ORDER BY path").to_pylist() == files_before
    assert ws.query("SELECT count(*) AS n FROM rollouts").to_pylist() == [{"n": 8}]
    out = _sql(s3, tmp_path / "ws", "SELECT count(*) AS n FROM rollouts")
    assert _rows(out) == [{"n": 8}]


def test_checkpoint_upload_without_marker_is_never_loaded(s3, tmp_path, monkeypatch):
    import boto3

    from storage.checkpoints import local_copy, publish
    from storage.settings import Settings

    monkeypatch.setenv("RLOPS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "ck-abc"
    (folder / "sub").mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    (folder / "sub" / "optimizer.pt").write_bytes(b"\x00" * 1000)
    settings = Settings.from_env(tmp_path / "ws")
    uri = publish(settings, folder)
    assert uri == f"s3://{BUCKET}/data/checkpoints/ck-abc"
    local = Path(local_copy(uri))
    assert (local / "sub" / "optimizer.pt").read_bytes() == b"\x00" * 1000
    assert local_copy(str(folder)) == str(folder)  # a local checkpoint is used where it is

    boto3.client("s3").delete_object(Bucket=BUCKET, Key="data/checkpoints/ck-abc/_COMPLETE")  # as if killed mid-upload
    monkeypatch.setenv("RLOPS_CACHE", str(tmp_path / "other-machine"))
    with pytest.raises(FileNotFoundError, match="incomplete"):
        local_copy(uri)
    assert not (tmp_path / "other-machine" / "checkpoints" / "ck-abc").exists()
