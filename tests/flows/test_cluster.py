"""A pipeline step on a real two-node Ray cluster (`ray start --head` + `ray start --address=...`):
rollout, scoring and a 2-worker DDP GRPO update.

The `rlops` driver runs as its own process, as a user runs it, with the cluster's token in its
environment; the head node has no CPUs, so rollout actors and scoring tasks must run on the worker
node. Each stage records where its Ray work ran (MLflow tag `rlops.ray_workers`:
`<node id>:<pid>:<parent pid>`), and the test checks those against the worker node's id and the
processes its `ray start` started. The nodes are started without this checkout on their
PYTHONPATH: the code reaches them through Ray's runtime_env (`ray.ship_code`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from storage.workspace import Workspace
from tests.flows.conftest import tiny_config
from tests.ray_cluster import LocalRayCluster


def _rlops(env: dict[str, str], *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "flows.cli", *args, "--json"], capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["artifact_id"]


def _placements(ws: Workspace, artifact_id: str) -> list[tuple[str, int, int]]:
    (run,) = [r for r in ws.catalog.stage_runs(artifact_id) if r["status"] == "complete"]
    tag = ws.tracker.client.get_run(run["mlflow_run_id"]).data.tags["rlops.ray_workers"]
    return [(node, int(pid), int(ppid)) for node, pid, ppid in (p.split(":") for p in tag.split(","))]


@pytest.mark.slow
def test_rollout_and_score_run_on_the_worker_node(tmp_path, tiny_model_dir):
    # The nodes import rlops only from what the driver ships (or an installed copy): not from this checkout.
    node_env = {"PYTHONPATH": ""}
    with LocalRayCluster(worker_cpus=2, env=node_env) as cluster:
        cfg = tiny_config(tiny_model_dir, name="cluster", steps=1)
        cfg.pop("sft")
        cfg["rollout"].update(workers=2, groups_per_shard=1)  # 2 prompts -> 2 shards -> 2 actors
        cfg["score"]["workers"] = 2
        cfg["ray"] = {"address": cluster.address}
        path = tmp_path / "cluster.yaml"
        path.write_text(yaml.safe_dump(cfg))
        driver_env = {**cluster.env, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        ws_args = ["--workspace", str(tmp_path / "ws")]

        batch = _rlops(driver_env, "stage", "rollout", str(path), "--policy", "base", *ws_args)
        scored = _rlops(driver_env, "stage", "score", str(path), "--rollouts", batch, *ws_args)
        worker_pids = cluster.worker_pids()  # while the node runs: its raylet is every worker's parent
        # Training uses the same section: two Ray Train DDP workers (the head has no CPU for them).
        policy = _rlops(driver_env, "stage", "grpo", str(path), "--policy", "base", "--rollouts", batch,
                        "--reward", "total", "--set", "grpo.workers=2", "--set", "grpo.lr=1e-3", *ws_args)

    ws = Workspace.open(tmp_path / "ws")
    assert ws.query("SELECT count(*) AS n FROM rollouts").to_pylist() == [{"n": 4}]
    assert ws.query("SELECT count(*) AS n FROM rewards").to_pylist() == [{"n": 4 * 3}]  # correct, short, total
    assert ws.catalog.get_artifact(scored) is not None
    rollout_at, score_at = _placements(ws, batch), _placements(ws, scored)
    assert len(rollout_at) == 2 and len(score_at) >= 1
    for node, pid, ppid in rollout_at + score_at:
        assert node == cluster.worker_node_id
        assert ppid in worker_pids and pid != os.getpid()
    checkpoint = ws.catalog.get_checkpoint(policy)
    assert checkpoint["kind"] == "grpo" and checkpoint["trained_on"]["batches"] == [batch]
    assert (tmp_path / "ws" / "checkpoints" / policy / "adapter_model.safetensors").exists()


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
