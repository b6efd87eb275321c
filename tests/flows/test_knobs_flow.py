"""The run-level training knobs (issue 55; flows/step_data.py): the curriculum skips what a run solved, a step
without signal replays an earlier batch that had some, and `rlops run --from` forks a lineage. Each decision is
read from the catalog, so a restarted run makes the same ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flows import pipeline
from flows.run_config import from_dict
from flows.step_data import fork_point
from stages.common import StageContext
from storage.workspace import Workspace
from tasks.base import load_task
from tests.flows.conftest import tiny_config

TASK = {"name": "arithmetic", "params": {"n_train": 4, "n_test": 2}}


def _config(model_dir: Path, name: str, steps: int, reward_params: dict[str, Any], **extra: Any) -> dict[str, Any]:
    cfg = tiny_config(model_dir, name=name, steps=steps)
    cfg.update(sft=None, task=TASK, **extra)
    cfg["score"] = {"rewards": [{"name": "scripted", "fn": "tests.flows.knob_rewards.scripted", "params": reward_params}]}
    cfg["eval"].update(n_prompts=2, every=10, metric="scripted")
    return cfg


def _prompts(ws: Workspace, batch: str) -> list[str]:
    return sorted(r["prompt_id"] for r in ws.query("SELECT DISTINCT prompt_id FROM rollouts WHERE batch_id = ?",
                                                   [batch]).to_pylist())


def test_curriculum_and_replay_decide_from_the_store_and_survive_a_restart(tmp_path: Path, tiny_model_dir: Path) -> None:
    p = [x.prompt_id for x in load_task(TASK["name"], TASK["params"]).prompts("train")]
    # step 0 draws p0 (solved by every sample) and p1 (a group with signal); step 1 draws p2 and p3 (no signal)
    params = {"solved": [p[0]], "signal": [p[1]]}
    knobs = {"curriculum": {"enabled": True, "skip_solved": 1}, "replay": {"enabled": True, "min_groups": 1}}
    ws = Workspace.open(tmp_path / "ws")
    ctx = StageContext(ws, run_name="knobs")
    rows: list[dict] = []
    first = pipeline.train(from_dict(_config(tiny_model_dir, "knobs", 2, params, **knobs)), ctx, on_step=rows.append)
    b0, b1 = first.batches
    assert (_prompts(ws, b0), _prompts(ws, b1)) == (sorted(p[:2]), sorted(p[2:]))
    # replay: step 1 had no signal, so it trained on step 0's batch too (its id names it) and on its signal group
    step1 = ws.catalog.get_checkpoint(first.policies[1])
    assert sorted(step1["trained_on"]["batches"]) == sorted([b0, b1])
    assert ws.catalog.get_artifact(first.policies[1])["meta"]["metrics"]["trained_rollouts"] == 2
    assert [r["replayed_batches"] for r in rows if "step" in r] == [0, 1]
    assert "entropy" in ws.catalog.get_artifact(first.policies[1])["meta"]["metrics"]

    # a restart with one more step: steps 0 and 1 are found, step 2 rebuilds the curriculum from the stored
    # rewards. Without it step 2 would draw p0 and p1 again; p0 was solved, so it walks on to p2.
    again = pipeline.train(from_dict(_config(tiny_model_dir, "knobs", 3, params, **knobs)), ctx, on_step=lambda r: None)
    assert again.policies[:2] == first.policies and again.batches[:2] == first.batches
    assert _prompts(ws, again.batches[2]) == sorted([p[1], p[2]])
    # the same run without the knobs: the usual slices, and step 1 trains on its own batch alone (no signal: nothing)
    plain = pipeline.train(from_dict(_config(tiny_model_dir, "plain", 3, params)), StageContext(ws, run_name="plain"),
                           on_step=lambda r: None)
    assert plain.batches[:2] == [b0, b1] and _prompts(ws, plain.batches[2]) == sorted(p[:2])
    assert ws.catalog.get_checkpoint(plain.policies[1])["trained_on"]["batches"] == [b1]
    assert ws.catalog.get_artifact(plain.policies[1])["meta"]["metrics"]["trained_rollouts"] == 0


def test_a_fork_starts_a_new_lineage_at_any_checkpoint(prefect_harness, tmp_path: Path, tiny_model_dir: Path) -> None:
    from flows.prefect_flows import train_flow

    p = [x.prompt_id for x in load_task(TASK["name"], TASK["params"]).prompts("train")]
    params = {"signal": p}  # every group carries signal: every update moves the weights
    ws_dir = str(tmp_path / "ws")
    parent = train_flow(_config(tiny_model_dir, "parent", 2, params), ws_dir)
    ws = Workspace.open(ws_dir)
    assert fork_point(ws, "parent@1") == (parent["policies"][0], 1)
    with pytest.raises(KeyError, match=r"no checkpoint at step 7 \(steps: \[1, 2\]\)"):
        fork_point(ws, "parent@7")

    changed = _config(tiny_model_dir, "fork", 1, params)
    changed["grpo"] = {"lr": 1e-2}
    fork = train_flow(changed, ws_dir, fork_from="parent@1")
    (forked,) = fork["policies"]
    checkpoint = ws.catalog.get_checkpoint(forked)
    # it shares its parent with the parent run's own step 2, and differs from it
    assert checkpoint["parent_id"] == parent["policies"][0] and forked != parent["policies"][1]
    assert checkpoint["run_name"] == "fork" and checkpoint["step"] == 2
    # the fork draws the prompts the parent's step 2 drew, generating from the same policy: the same batch
    assert fork["batches"] == parent["batches"][1:]
    (run,) = [r for r in ws.catalog.runs() if r["run_name"] == "fork"]
    assert run["config"]["forked_from"] == "parent@1" and run["config"]["fork_policy"] == parent["policies"][0]
    tags = ws.tracker.client.get_run(fork["mlflow_run_id"]).data.tags
    assert tags["rlops.forked_from"] == "parent@1" and tags["rlops.fork_step"] == "1"
