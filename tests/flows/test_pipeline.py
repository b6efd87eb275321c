"""The pipeline end to end under Prefect with a tiny model: every stage, every view, MLflow, a report;
rescored and retrained without generation. (`rlops run` killed and resumed: tests/flows/test_orphans.py.)"""

from __future__ import annotations

import json
import os

import mlflow

from flows import pipeline
from flows.run_config import from_dict
from stages.common import StageContext
from storage.workspace import Workspace
from tests.flows.conftest import expected_rows, row_counts, tiny_config


def test_flow_runs_every_stage_and_fills_every_view(prefect_harness, tmp_path, tiny_model_dir):
    from flows.prefect_flows import train_flow
    from flows.views.report import write_report

    cfg = tiny_config(tiny_model_dir)
    ws_dir = tmp_path / "ws"
    summary = train_flow(cfg, str(ws_dir))
    ws = Workspace.open(ws_dir)

    counts = row_counts(ws)
    expected = expected_rows(cfg)
    assert {k: counts[k] for k in expected} == expected
    assert counts["distinct_rollouts"] == counts["rollouts"] and counts["distinct_rewards"] == counts["rewards"]
    assert summary["sft"] and summary["final"] == summary["policies"][-1] and len(summary["policies"]) == 2
    evals = ws.query("SELECT DISTINCT policy_id FROM evals").to_pylist()
    assert {e["policy_id"] for e in evals} == {summary["base"], summary["sft"], *summary["policies"]}
    lineage = {c["policy_id"]: c for c in ws.catalog.checkpoints("e2e")}
    final = lineage[summary["final"]]
    assert final["kind"] == "grpo" and final["step"] == 2 and final["trained_on"]["reward"].startswith("total@")
    assert lineage[final["parent_id"]]["parent_id"] == summary["sft"]
    assert ws.catalog.get_run("e2e")["status"] == "complete"

    mlflow.set_tracking_uri(ws.settings.mlflow_uri)
    children = mlflow.search_runs(experiment_names=["rlops"],
                                  filter_string=f"tags.mlflow.parentRunId = '{summary['mlflow_run_id']}'")
    stages = set(children["tags.rlops.stage"])
    assert {"sft", "rollout", "reward_set", "grpo", "evaluate"} <= stages
    assert set(children["tags.rlops.artifact_id"]) >= set(summary["policies"] + summary["batches"])

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:  # the per-step and evaluation summaries reached Prefect
        keys = {a.key for a in client.read_artifacts()}
    assert {"e2e-step", "e2e-eval", "e2e-evals"} <= keys

    index = write_report(ws, "e2e")
    assert index.exists() and (index.parent / "reward_by_step.png").stat().st_size > 1000
    logged = mlflow.MlflowClient().list_artifacts(summary["mlflow_run_id"], "report")
    assert {os.path.basename(a.path) for a in logged} >= {"index.html", "reward_by_step.png"}

    # a rerun recomputes nothing: every stage is found in the catalog
    again = train_flow(cfg, str(ws_dir))
    assert again["final"] == summary["final"] and row_counts(ws) == counts
    statuses = ws.query("SELECT status, count(*) AS n FROM stage_runs GROUP BY 1").to_pylist()
    assert {s["status"] for s in statuses} == {"complete", "cached"}


def test_rescore_and_retrain_without_generation(tmp_path, tiny_model_dir):
    ws = Workspace.open(tmp_path / "ws")
    cfg_dict = tiny_config(tiny_model_dir, name="r")
    cfg_dict["sft"] = None
    cfg = from_dict(cfg_dict)
    result = pipeline.train(cfg, StageContext(ws, run_name="r"))
    rollouts_before = ws.query("SELECT count(*) AS n FROM rollouts").to_pylist()[0]["n"]

    edited = dict(cfg_dict, score={"rewards": [{"name": "correct", "fn": "rewards.builtin.numeric_match"},
                                               {"name": "short", "fn": "rewards.builtin.length_penalty",
                                                "params": {"limit": 16}, "weight": 0.1}]})
    new_cfg = from_dict(edited)
    new_version = pipeline.score.versions(new_cfg.score)
    ctx = StageContext(ws, run_name="r-retrain")
    pipeline.rescore(new_cfg, ctx, "r")
    lineage = pipeline.retrain(new_cfg, ctx, result.base, "r")

    assert ws.query("SELECT count(*) AS n FROM rollouts").to_pylist()[0]["n"] == rollouts_before  # nothing generated
    assert ws.query(f"SELECT count(*) AS n FROM rewards WHERE reward_name = 'short' AND reward_version = "
                    f"'{new_version['short']}'").to_pylist()[0]["n"] == 2 * 2 * 2  # both training batches
    # 'correct' did not change, so it was not rescored: one version only
    assert ws.query("SELECT count(DISTINCT reward_version) AS n FROM rewards WHERE reward_name = 'correct'").to_pylist() == [{"n": 1}]
    assert len(lineage) == 2 and set(lineage).isdisjoint(result.policies)
    new_final = ws.catalog.get_checkpoint(lineage[-1])
    assert new_final["trained_on"]["reward"] == f"total@{new_version['total']}"
    assert new_final["run_name"] == "r-retrain"
    assert ws.catalog.get_checkpoint(lineage[0])["parent_id"] == result.base


def test_a_continued_lineage_picks_up_prompts_added_since_the_last_run(tmp_path, tiny_model_dir):
    data = tmp_path / "problems.jsonl"
    rows = [{"question": f"What is {a} + 1?", "answer": a + 1, "split": "train"} for a in range(10, 14)]
    rows.append({"question": "What is 50 + 50?", "answer": 100, "split": "test"})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg_dict = tiny_config(tiny_model_dir, name="nightly")
    cfg_dict.update(sft=None, task={"name": "arithmetic", "params": {"data_file": str(data)}})
    cfg_dict["eval"]["n_prompts"] = 1
    ws = Workspace.open(tmp_path / "ws")
    ctx = StageContext(ws, run_name="nightly")
    first = pipeline.train(from_dict(cfg_dict), ctx)  # 2 steps x 2 prompts: all four train rows

    added = [{"question": f"What is {a} + 2?", "answer": a + 2, "split": "train"} for a in (70, 71)]
    with data.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in added))
    cfg_dict["steps"] = 1
    latest = ws.catalog.get_checkpoint(first.final)
    second = pipeline.train(from_dict(cfg_dict), ctx, start_policy=first.final, start_step=latest["step"])
    questions = ws.query(f"SELECT DISTINCT messages[2].content AS q FROM rollouts WHERE batch_id = '{second.batches[0]}'"
                         ).to_pylist()
    assert sorted(r["q"] for r in questions) == ["What is 70 + 2?", "What is 71 + 2?"]
    assert ws.catalog.get_checkpoint(second.final)["parent_id"] == first.final
    assert ws.catalog.get_checkpoint(second.final)["step"] == 3


def test_every_step_summary_field_appears(tmp_path, tiny_model_dir):
    """The per-step line shows the step's reward and each GRPO field it names (none silently missing)."""
    cfg = from_dict({**tiny_config(tiny_model_dir, name="fields", steps=1), "sft": None, "eval": {"n_prompts": 1}})
    rows: list[dict] = []
    pipeline.train(cfg, StageContext(Workspace.open(tmp_path / "ws"), run_name="fields"), on_step=rows.append)
    steps = [r for r in rows if "step" in r]
    assert len(steps) == 1
    assert {"step", "batch", "policy", "reward_mean", *pipeline.STEP_FIELDS} <= set(steps[0])
