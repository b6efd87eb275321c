""".ci/loopback, which `make test`, `make demo` and the benchmarks run under: only loopback exists
inside, and a SIGTERM to the process group of a running `make test` leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from tests.netguard import in_namespace

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = ROOT / ".ci" / "loopback"

# A test that starts a real server of each kind the suite uses, each in a session of its own, then waits
# to be killed: the Prefect server fixture, a two-node Ray cluster, a moto S3 server, and uvicorn.
VICTIM = textwrap.dedent('''
    import os
    import time
    from pathlib import Path

    from tests.flows.conftest import prefect_server  # noqa: F401 - `prefect server start`, its own session
    from tests.ray_cluster import LocalRayCluster
    from tests.storage.test_object_store import s3  # noqa: F401 - `moto_server`


    def test_servers_then_wait(prefect_server, s3, tmp_path):
        from fastapi import FastAPI

        from stages.service.app import ServerThread

        with LocalRayCluster(worker_cpus=1), ServerThread(FastAPI()):
            Path(os.environ["VICTIM_READY"]).write_text("up")
            time.sleep(900)
''')


def _marked(mark: str) -> list[int]:
    """Processes whose environment carries `mark` (every process the victim started inherits it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if mark.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def _kill_group_when_ready(cmd: list[str], tmp_path: Path, env: dict[str, str]) -> tuple[int, list[int]]:
    """Start `cmd` in a process group of its own, SIGTERM the group once the victim's servers are up;
    returns (exit code, the marked processes still alive 60 s later)."""
    mark = uuid.uuid4().hex
    ready = tmp_path / "ready"
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**env, "RLOPS_TEST_MARK": mark, "VICTIM_READY": str(ready)},
                            stdout=(log := open(tmp_path / "victim.log", "wb")), stderr=log,  # pytest reports on stdout
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not ready.exists():
            assert proc.poll() is None, (tmp_path / "victim.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the victim's servers did not start"
            time.sleep(0.5)
        assert len(_marked(mark)) > 5  # pytest, make, Prefect's server, two Ray nodes and their workers, moto
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=120)
        left = _marked(mark)
        deadline = time.monotonic() + 60
        while left and time.monotonic() < deadline:
            time.sleep(1)
            left = _marked(mark)
        return code, left
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_only_loopback_exists_inside():
    env = {k: v for k, v in os.environ.items() if k != "RLOPS_LOOPBACK"}
    out = subprocess.run([str(LOOPBACK), sys.executable, "-c",
                          "import os; print(open('/proc/net/dev').read()); print(os.environ['RLOPS_LOOPBACK'], os.getpid())"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    interfaces = [line.split(":")[0].strip() for line in out.stdout.splitlines() if ":" in line]
    assert interfaces == ["lo"]
    assert out.stdout.split()[-2:] == ["1", "2"]  # inside; the command is PID 2 (the wrapper is PID 1)
    code = subprocess.run([str(LOOPBACK), sys.executable, "-c", "import sys; sys.exit(7)"], env=env, timeout=60).returncode
    assert code == 7


@pytest.mark.slow
@pytest.mark.skipif(not in_namespace(), reason="needs a namespace to nest in (run through make test)")
def test_sigterm_to_the_process_group_of_make_test_leaves_no_process_behind(tmp_path):
    (tmp_path / "test_victim.py").write_text(VICTIM)
    env = {k: v for k, v in os.environ.items() if k != "RLOPS_LOOPBACK"}
    env["PYTHONPATH"] = str(ROOT)
    # One xdist worker (pytest's controller and a worker, as in CI's run): each more imports the stack for nothing.
    code, left = _kill_group_when_ready(["make", "test", "WORKERS=1",
                                         f"TESTS=-p tests.netguard -p no:cacheprovider {tmp_path}"],
                                        tmp_path, env)
    assert left == [], f"left running: {left}"
    assert code != 0


@pytest.mark.slow
def test_sigterm_to_pytest_without_a_namespace_stops_every_server(tmp_path):
    # Where no namespace can be made, pytest itself turns SIGTERM into a teardown (tests/netguard.py).
    (tmp_path / "test_victim.py").write_text(VICTIM)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RLOPS_LOOPBACK": "1"}
    code, left = _kill_group_when_ready([sys.executable, "-m", "pytest", "-p", "tests.netguard", "-p", "no:cacheprovider",
                                         str(tmp_path)], tmp_path, env)
    assert left == [], f"left running: {left}"
    assert code == 2  # interrupted
