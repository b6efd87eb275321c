"""Write failures under a real file-size limit: a Parquet part, a GRPO checkpoint and MLflow writes.

Each write runs in a subprocess under `RLIMIT_FSIZE` (SIGXFSZ ignored, so a write past the limit
fails with EFBIG as on a full disk instead of killing the process). The failure must name the path,
leave nothing partial in the files or the catalog, and the same write must succeed once the limit
is gone (the rerun happens here, in the test process, which has no limit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from stages.common import StageContext
from stages.policy.lora import LoRASettings
from storage.schema import to_table
from storage.workspace import Workspace
from tests.factories import tool_episode

REPO = Path(__file__).resolve().parents[2]

PREAMBLE = textwrap.dedent(
    """\
    import json, resource, signal, sys
    from storage.atomic import WriteError

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG, as on a full disk


    def limit_file_size(n):
        resource.setrlimit(resource.RLIMIT_FSIZE, (n, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


    def report(fn):
        try:
            fn()
        except Exception as e:
            print(json.dumps({"type": type(e).__name__, "message": str(e), "write_error": isinstance(e, WriteError)}))
        else:
            print(json.dumps({"type": None}))
    """
)


def run_limited(body: str, *args: str) -> list[dict[str, Any]]:
    """Run PREAMBLE + body in a fresh interpreter; return the reports it printed, in order."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", PREAMBLE + textwrap.dedent(body), *args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"type"')]


def rollouts(n_groups: int) -> list:
    # Random answers, so the Parquet file stays large after compression (~1.5 KB a row).
    return [tool_episode("ro-big", g, s, answer=os.urandom(1500).hex()) for g in range(n_groups) for s in range(8)]


def test_a_parquet_part_that_does_not_fit_leaves_nothing(tmp_path: Path) -> None:
    ws = Workspace.open(tmp_path / "ws")  # the catalog exists before the limit
    table = to_table(rollouts(40))  # 320 rows, ~1 MB of Parquet
    table_file = tmp_path / "table.arrow"
    import pyarrow as pa

    with pa.OSFile(str(table_file), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)

    (report,) = run_limited(
        """
        import pyarrow as pa
        from storage.workspace import Workspace

        ws = Workspace.open(sys.argv[1])
        table = pa.ipc.open_file(sys.argv[2]).read_all()
        limit_file_size(256 * 1024)
        report(lambda: ws.write_part("rollouts", "ro-big", table, part="part-0"))
        """,
        str(ws.root), str(table_file),
    )
    final = Path(ws.data.artifact_dir("rollouts", "ro-big")) / "part-0.parquet"
    assert report["write_error"] and report["message"].endswith(f"cannot write {final}: File too large")
    assert list(final.parent.iterdir()) == []  # no part, no temp file
    assert ws.catalog.artifact_files("ro-big") == []
    assert ws.query("SELECT count(*) AS n FROM rollouts").to_pylist() == [{"n": 0}]

    ws.write_part("rollouts", "ro-big", table, part="part-0")  # space is back: the same write completes
    ws.catalog.complete_artifact("ro-big", "rollouts", "rollout", [], "cfg")
    assert ws.query("SELECT count(*) AS n FROM rollouts").to_pylist() == [{"n": 320}]
    assert [p.name for p in final.parent.iterdir()] == ["part-0.parquet"]


# A LoRA this wide on every projection of the tiny model makes an ~8 MB adapter and a ~17 MB optimizer
# state, while the catalog and MLflow databases stay under ~3 MB: a 6 MiB limit fails only the checkpoint.
WIDE_LORA = LoRASettings(r=2048, alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"])


@pytest.mark.slow
def test_a_checkpoint_that_does_not_fit_leaves_nothing(tmp_path: Path) -> None:
    from stages.grpo import run
    from stages.reward_ref import RewardRef
    from tests.stages.test_grpo import STAGE, make_workspace

    ws, parent, batch = make_workspace(tmp_path)
    _ = ws.tracker  # the MLflow database exists before the limit
    config = STAGE.model_copy(update={"lora": WIDE_LORA})
    (report,) = run_limited(
        """
        from stages.common import StageContext
        from stages.grpo import run
        from stages.reward_ref import RewardRef
        from stages.update.config import GRPOConfig
        from storage.workspace import Workspace

        ws = Workspace.open(sys.argv[1])
        config = GRPOConfig.model_validate_json(sys.argv[4])
        limit_file_size(6 << 20)
        report(lambda: run(config, StageContext(ws, run_name="limited"), sys.argv[2], [sys.argv[3]], RewardRef("toy")))
        """,
        str(ws.root), parent, batch, config.model_dump_json(),
    )
    folder = ws.settings.checkpoints_dir
    assert report["write_error"], report
    assert f"cannot write {folder}/ck-" in report["message"] and "File too large" in report["message"]
    assert list(folder.iterdir()) == []  # neither a checkpoint nor its temp folder
    assert [c["kind"] for c in ws.catalog.checkpoints()] == ["base"]
    failed = ws.query("SELECT status, error FROM stage_runs WHERE stage = 'grpo'").to_pylist()
    assert [r["status"] for r in failed] == ["failed"] and "File too large" in failed[0]["error"]

    ref = run(config, StageContext(ws, run_name="rerun"), parent, [batch], RewardRef("toy"))  # no limit now
    assert not ref.cached and [c["kind"] for c in ws.catalog.checkpoints()] == ["base", "grpo"]
    assert {"adapter_model.safetensors", "optimizer.pt", "trainer_state.json"} <= {
        p.name for p in (folder / ref.id).iterdir()}
    assert [p.name for p in folder.iterdir()] == [ref.id]


@pytest.mark.slow
def test_mlflow_writes_that_do_not_fit_name_the_database_and_record_nothing(tmp_path: Path) -> None:
    ws = Workspace.open(tmp_path / "ws")
    tracker = ws.tracker
    run_id = tracker.start_run("limited")
    big = tmp_path / "report.bin"
    big.write_bytes(os.urandom(3 << 20))
    params = {f"p{i}": "x" * 5000 for i in range(400)}  # ~2 MB of rows: the database must grow
    reports = run_limited(
        """
        import os
        from storage.workspace import Workspace

        ws = Workspace.open(sys.argv[1])
        tracker = ws.tracker
        params = {f"p{i}": "x" * 5000 for i in range(400)}
        limit_file_size(os.path.getsize(ws.root / "mlflow.db"))  # not one byte more: any growth fails
        report(lambda: tracker.log_params(sys.argv[2], params))
        limit_file_size(1 << 20)
        report(lambda: tracker.log_artifact(sys.argv[2], sys.argv[3], "reports"))
        """,
        str(ws.root), run_id, str(big),
    )
    db = ws.root / "mlflow.db"
    assert reports[0]["write_error"] and f"cannot write {db}: SQLite: disk I/O error" in reports[0]["message"]
    artifacts = Path(ws.settings.mlflow_artifacts).resolve()
    assert reports[1]["write_error"] and f"cannot write {artifacts}/" in reports[1]["message"]
    assert reports[1]["message"].endswith("/reports/report.bin: File too large")
    recorded = tracker.client.get_run(run_id)
    assert recorded.data.params == {}  # the failed transaction was rolled back whole
    assert tracker.client.list_artifacts(run_id, "reports") == []  # MLflow made the folder, never the file
    assert [p for p in artifacts.rglob("*") if p.is_file()] == []

    tracker.log_params(run_id, params)  # space is back: the same writes complete
    tracker.log_artifact(run_id, big, "reports")
    assert len(tracker.client.get_run(run_id).data.params) == 400
    assert [a.path for a in tracker.client.list_artifacts(run_id, "reports")] == ["reports/report.bin"]
    tracker.end_run(run_id)
