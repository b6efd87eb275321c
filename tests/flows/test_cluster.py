"""A whole run on a real two-node Ray cluster (`ray start --head` + `ray start --address=...`) where every
stage asks for 2 Ray workers on 2 CPUs (the run's resident rollout actors must not starve the score tasks and
the 2-worker DDP GRPO update), whose update workers are killed mid-step. (The same run on rlops' own 2-CPU
local Ray is tests/flows/test_async_ray.py's demo-config test.)

The `rlops` driver runs as its own process, as a user runs it, with the cluster's token in its
environment; the head node has no CPUs, so rollout actors and scoring tasks must run on the worker
node. Each stage records where its Ray work ran (MLflow tag `rlops.ray_workers`:
`<node id>:<pid>:<parent pid>`), and the test checks those against the worker node's id and the
processes its `ray start` started. The nodes are started without this checkout on their
PYTHONPATH: the code reaches them through Ray's runtime_env (`ray.ship_code`).

Each driver is its own Ray job; a job's actors and workers end with it, so the next driver finds the worker
node's 2 CPUs free again. (Rollout, scoring and the update placed on the worker node were once a test of their
own, of `rlops stage` commands on the same cluster: three more drivers and six more Ray workers, ~50 s of CPU,
for what the run's stages show as well; those commands are tests/flows/test_cli_stages.py's.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from storage.workspace import Workspace
from tests.flows.conftest import ray_workers, tiny_config
from tests.ray_cluster import LocalRayCluster


def _placements(ws: Workspace, artifact_id: str) -> list[tuple[str, int, int]]:
    return [(node, int(pid), int(ppid)) for node, pid, ppid in (w.split(":") for w in ray_workers(ws, artifact_id))]


@pytest.fixture
def two_nodes() -> Iterator[LocalRayCluster]:
    """A `ray start` head (no CPUs) and worker (2 CPUs)."""
    # The nodes import rlops only from what the driver ships (or an installed copy): not from this checkout.
    with LocalRayCluster(worker_cpus=2, env={"PYTHONPATH": ""}) as cluster:
        yield cluster


def test_moved_ray_address_is_a_clear_config_error(tiny_model_dir):
    from flows.config import ConfigError
    from flows.run_config import from_dict

    cfg = tiny_config(tiny_model_dir)
    cfg["rollout"]["ray_address"] = "127.0.0.1:6379"
    with pytest.raises(ConfigError, match="ray: {address"):
        from_dict(cfg)
    cfg["rollout"].pop("ray_address")
    cfg["ray"] = {"address": "127.0.0.1:6379", "runtime_env": {"env_vars": {"A": "1"}}}
    assert from_dict(cfg).ray.address == "127.0.0.1:6379"


def _update_worker_titles(cluster: LocalRayCluster) -> dict[int, str]:
    """pid -> process title of the worker node's update workers. Ray titles a worker after its actor class, and
    after the method it runs: `ray::UpdateWorker` idle, `ray::UpdateWorker.step` while it trains a step."""
    import psutil

    titles = {}
    for pid in cluster.worker_pids():
        try:
            title = psutil.Process(pid).cmdline()[0]
        except (psutil.Error, IndexError):
            continue
        if title.startswith("ray::UpdateWorker"):
            titles[pid] = title
    return titles


def _title(pid: int) -> str:
    """A process's title (Ray sets it as the first word of its command line); "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def _kill_in_step(cluster: LocalRayCluster, proc: subprocess.Popen, log: Path, spare: set[int]) -> tuple[int, set[int]]:
    """SIGKILL the first update worker (not in `spare`) seen inside a step: its pid, and every update worker (not in
    `spare`) listed with it, its group (to spare next: listed later, a dying peer's title can read as anything while
    Ray rewrites it, and a spare missed so was once the "fresh group's worker" killed). Fails if the run ends first.

    Listing the node's processes scans all of /proc (psutil), which at a 10 ms poll took a good part of a core
    from the rest of the suite; so the node is listed 4 times a second until a group's workers exist (they load
    the model before their first step), then only those workers' titles are read, 10 ms apart."""
    import signal
    import time

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended before a worker could be killed:\n{log.read_text()[-3000:]}"
        workers = [pid for pid in _update_worker_titles(cluster) if pid not in spare]
        for _ in range(100 if workers else 0):
            for pid in workers:
                if _title(pid).startswith("ray::UpdateWorker.step"):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:  # it ended between the read and the kill: look again
                        continue
                    return pid, set(workers)
            time.sleep(0.01)
        time.sleep(0 if workers else 0.25)
    raise AssertionError("no update worker was seen inside a step within 300 s")


ODD_SAMPLE = """
from rewards.base import reward


@reward(low=0.0, high=1.0)
def odd_sample(rollout) -> float:
    \"\"\"1 for every other sample of a group: every group has signal, so every step moves the weights.\"\"\"
    return float(rollout.sample_idx % 2)
"""


@pytest.mark.slow
def test_two_node_every_stage_on_two_workers_survives_killed_update_workers_and_a_run_too_big_is_refused(
        tmp_path, tiny_model_dir, two_nodes):
    """A 2-step run on the two-node cluster whose every stage asks for 2 Ray workers (resident rollout actors,
    score tasks, and `grpo.workers: 2`) on the worker node's 2 CPUs, with one of the two update workers SIGKILLed
    inside step 0: the step is retried once by a fresh group. When the fresh group's worker is killed too, the run
    fails naming that worker, and no checkpoint of the step exists. The rerun resumes (rollouts and scores are
    found), its first group loses a worker the same way and is replaced, the replacement group stays for step 1,
    and the run ends with step 0's checkpoint under the id the failed step had, whose weights are the in-process
    update's: nothing of a partial gradient was kept, and every stage's Ray work ran on the worker node. Before all that, a run asking for 3 update workers is refused
    before any rollout. (One test, so the cluster runs one such driver: each costs a Prefect server and a group.)"""
    from safetensors.torch import load_file

    from stages import grpo
    from stages.common import StageContext
    from stages.reward_ref import RewardRef
    from stages.update.config import GRPOConfig
    from tests.flows.test_async import async_config

    cluster = two_nodes
    driver_env = {**cluster.env, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    # The nodes do not import this checkout's tests: the reward is a file both the driver and the score tasks read.
    (tmp_path / "odd.py").write_text(ODD_SAMPLE)
    cfg = async_config(tiny_model_dir, "faults", k=0, steps=2)
    cfg["score"]["rewards"][0]["fn"] = f"{tmp_path / 'odd.py'}:odd_sample"
    cfg["rollout"].update(workers=2, groups_per_shard=1)
    cfg["score"]["workers"] = 2
    # 8 single-sequence micro-batches x 2 epochs: a step long enough to be caught inside
    # lr 1e-3: at 0.05, 32 Adam steps grow the two summation orders' float differences to ~1e-3 (measured), beyond
    # the 1e-5 that tells a whole update from one that kept a partial gradient.
    cfg["grpo"] = {"workers": 2, "lr": 1e-3, "epochs": 2, "micro_batch_size": 1}
    cfg["ray"] = {"address": cluster.address, "placement_timeout_s": 60}  # a regression ends in an error, not a hang

    too_big = {**cfg, "name": "too-big", "grpo": {**cfg["grpo"], "workers": 3}}
    path = tmp_path / "too_big.yaml"
    path.write_text(yaml.safe_dump(too_big))
    out = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(path), "--workspace", str(tmp_path / "big")],
                         capture_output=True, text=True, timeout=600, env=driver_env)
    assert out.returncode != 0
    assert f"grpo.workers: 3 needs 3 CPUs at once; the Ray cluster at {cluster.address} has 2" in out.stderr
    assert Workspace.open(tmp_path / "big").query("SELECT count(*) AS n FROM rollouts").to_pylist() == [{"n": 0}]

    path = tmp_path / "faults.yaml"
    path.write_text(yaml.safe_dump(cfg))
    workspace = tmp_path / "ws"

    def start(log: Path) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(path), "--workspace", str(workspace)],
                                stdout=subprocess.DEVNULL, stderr=log.open("wb"), env=driver_env)

    first_log, rerun_log = tmp_path / "first.log", tmp_path / "rerun.log"
    earlier = set(_update_worker_titles(cluster))  # other tests' workers on the shared cluster, maybe still ending
    run = start(first_log)
    killed, first_group = _kill_in_step(cluster, run, first_log, spare=earlier)
    retry_spare = earlier | first_group | set(_update_worker_titles(cluster))  # the first group: the retry starts anew
    killed_again, _ = _kill_in_step(cluster, run, first_log, spare=retry_spare)
    assert run.wait(timeout=300) != 0
    err = first_log.read_text()
    assert f"pid {killed}) died" in err and "retrying the step once with a fresh worker group" in err
    assert f"pid {killed_again}) died" in err and "which failed too" in err
    ws = Workspace.open(workspace)
    (failed,) = [r for r in ws.query("SELECT artifact_id, status FROM stage_runs WHERE stage = 'grpo'").to_pylist()]
    assert failed["status"] == "failed"
    assert ws.catalog.get_checkpoint(failed["artifact_id"]) is None
    assert not (workspace / "checkpoints" / failed["artifact_id"]).exists()

    earlier = set(_update_worker_titles(cluster))  # the failed run's, maybe still ending
    run = start(rerun_log)
    killed, _ = _kill_in_step(cluster, run, rerun_log, spare=earlier)
    assert run.wait(timeout=300) == 0, rerun_log.read_text()[-4000:]
    assert f"pid {killed}) died" in rerun_log.read_text()
    ws = Workspace.open(workspace)
    assert ws.query("SELECT count(*) AS n FROM rollouts WHERE split = 'train'").to_pylist() == [{"n": 2 * 2 * 4}]
    # Where each stage's Ray work ran: every training batch on the two rollout actors, its scores in score tasks,
    # each step's update on two workers; all on the worker node (the head has no CPUs), in processes its raylet
    # started (the raylet outlives the jobs: still the parent of record), none in the driver or this process.
    worker_pids = cluster.worker_pids()
    batches = [a["artifact_id"] for a in ws.catalog.artifacts("rollouts") if a["meta"].get("split") == "train"]
    scores = [r["artifact_id"] for r in ws.catalog.stage_runs() if r["stage"] == "reward_set" and r["status"] == "complete"]
    updates = [c["policy_id"] for c in ws.catalog.checkpoints("faults") if c["kind"] == "grpo"]
    assert len(batches) == 2 and len(updates) == 2 and len(scores) >= 2
    assert all(len(_placements(ws, batch)) == 2 for batch in batches)
    assert all(len(_placements(ws, policy)) == 2 for policy in updates)
    for node, pid, ppid in (p for artifact in batches + scores + updates for p in _placements(ws, artifact)):
        assert node == cluster.worker_node_id
        assert ppid in worker_pids and pid != os.getpid()
    final, last = [c for c in ws.catalog.checkpoints("faults") if c["kind"] == "grpo"]  # in order of creation
    assert last["parent_id"] == final["policy_id"]
    assert final["policy_id"] == failed["artifact_id"]  # the rerun's step 0 ends where the failed step would have
    folder = Path(final["adapter_uri"])
    kept = load_file(str(folder / "adapter_model.safetensors"))
    # The same update in this process, one worker (forced: the checkpoint is rewritten under the same id).
    ref = grpo.run(GRPOConfig(**{**cfg["grpo"], "workers": 1}), StageContext(ws, run_name="recheck", force=True),
                   parent_policy=final["parent_id"], batches=final["trained_on"]["batches"],
                   reward=RewardRef.parse(final["trained_on"]["reward"]))
    assert ref.id == final["policy_id"]
    alone = load_file(str(folder / "adapter_model.safetensors"))
    assert max(float((kept[k] - alone[k]).abs().max()) for k in kept) < 1e-5
    assert max(float(kept[k].abs().max()) for k in kept if "lora_B" in k) > 1e-3  # B starts at 0: the step moved it
