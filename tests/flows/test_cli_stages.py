"""The stage commands of `rlops`, as a user runs them: each prints its artifact id as the last line.

The first command runs as an `rlops` subprocess, as a shell runs it; the rest of the chain (score, grpo, sft,
evaluate, then the read-only eval compare, rewards ls, ls) goes through the same entry point, `flows.cli.main`,
in this process: each subprocess spent ~7 s of CPU importing the stack this process has already imported
(docs/BENCHMARKS.md, "Where the suite's CPU goes"). The stage commands as subprocesses on a Ray cluster:
tests/flows/test_cluster.py."""

from __future__ import annotations

import json
import subprocess
import sys

import yaml

from storage.workspace import Workspace
from tests.flows.conftest import rlops_here, tiny_config


def _rlops(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_stage_commands_chain_by_printed_ids(tmp_path, tiny_model_dir, capsys):
    cfg = tmp_path / "t.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(tiny_model_dir, name="cli")))
    ws = ["--workspace", str(tmp_path / "ws")]

    batch = _rlops("stage", "rollout", str(cfg), "--policy", "base", *ws).stdout.strip().splitlines()[-1]
    assert batch.startswith("ro-")
    scored = json.loads(rlops_here(capsys, "stage", "score", str(cfg), "--rollouts", batch, "--json", *ws
                                    ).splitlines()[-1])
    assert scored["artifact_id"].startswith("rs-")
    policy = rlops_here(capsys, "stage", "grpo", str(cfg), "--policy", "base", "--rollouts", batch, "--reward",
                         "total", "--set", "grpo.lr=1e-3", *ws).strip().splitlines()[-1]
    assert policy.startswith("ck-")
    sft = rlops_here(capsys, "stage", "sft", str(cfg), *ws).strip().splitlines()[-1]
    for p in ("base", policy):
        assert rlops_here(capsys, "stage", "evaluate", str(cfg), "--policy", p, *ws).strip().splitlines()[-1
                                                                                                    ].startswith("ev-")

    w = Workspace.open(tmp_path / "ws")
    trained = w.catalog.get_checkpoint(policy)
    assert trained["trained_on"]["batches"] == [batch] and trained["trained_on"]["reward"].startswith("total@")
    assert trained["config_hash"] and w.catalog.get_checkpoint(sft)["kind"] == "sft"

    base_id = trained["parent_id"]
    compare = rlops_here(capsys, "eval", "compare", base_id, policy, *ws)
    assert "accuracy" in compare and base_id in compare and policy in compare
    paired = json.loads(rlops_here(capsys, "eval", "compare", base_id, policy, "--json", *ws).splitlines()[-1])
    rates = {p: w.query(  # each prompt's success rate in the policy's eval rollouts, by hand
        "SELECT r.prompt_id, avg(CASE WHEN w.value >= 1 THEN 1.0 ELSE 0.0 END) AS rate FROM rollouts r "
        "JOIN rewards w USING (rollout_id) WHERE w.reward_name = 'correct' AND r.split = 'test' "
        "AND r.policy_id = $p GROUP BY ALL", {"p": p}).to_pylist() for p in (base_id, policy)}
    assert paired["prompts"] == 4 and paired["metric"].startswith("correct@")
    for key, p in (("accuracy_a", base_id), ("accuracy_b", policy)):
        assert abs(paired[key] - sum(r["rate"] for r in rates[p]) / 4) < 1e-9
    assert paired["low"] <= paired["difference"] <= paired["high"]
    rewards = rlops_here(capsys, "rewards", "ls", *ws)
    assert "correct" in rewards and "total" in rewards and policy in rewards  # where each version was used
    listing = rlops_here(capsys, "ls", "checkpoints", *ws)
    assert policy in listing and sft in listing
