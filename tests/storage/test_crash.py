"""A writer killed mid-write leaves no visible partial file and an unchanged catalog."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.processes import kill, wait_until
from tests.storage.conftest import add_batch

WRITER = textwrap.dedent("""
    import sys
    from storage.schema import to_table
    from storage.workspace import Workspace
    from tests.factories import tool_episode

    ws = Workspace.open(sys.argv[1])
    rows = [tool_episode("ro-big", g, s) for g in range(400) for s in range(8)]
    table = to_table(rows)
    import pyarrow as pa
    big = pa.concat_tables([table] * 40)  # ~130k rows: long enough to be killed while writing
    print("writing", flush=True)
    ws.write_part("rollouts", "ro-big", big, part="group-00000")
    ws.catalog.complete_artifact("ro-big", "rollouts", "rollout", [], "cfg")
    print("done", flush=True)
""")


def test_writer_killed_mid_write_leaves_nothing_visible(ws):
    add_batch(ws, "ro-a")
    files_before = ws.query("SELECT * FROM files ORDER BY path").to_pylist()
    folder = Path(ws.data.artifact_dir("rollouts", "ro-big"))
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(ws.root)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    wait_until(lambda: folder.exists() and any(p.name.endswith(".tmp") for p in folder.iterdir()), proc,
               "a .tmp file was written (it finished before it could be killed)", timeout=60, every=0.002)
    kill(proc, group=False)

    assert [p for p in folder.iterdir() if p.suffix == ".parquet"] == []  # only the hidden .tmp remains
    assert ws.query("SELECT * FROM files ORDER BY path").to_pylist() == files_before
    assert ws.catalog.get_artifact("ro-big") is None
    assert ws.query("SELECT count(*) AS n FROM rollouts").to_pylist() == [{"n": 8}]
