"""MLflow parent/child runs with tags, read back through mlflow.search_runs (SQLite backend)."""

from __future__ import annotations

import mlflow


def test_parent_and_child_runs_with_tags(ws):
    tracker = ws.tracker
    parent = tracker.start_run("pipeline-nightly", tags={"rlops.run_name": "nightly"}, params={"grpo": {"lr": 1e-4}})
    with tracker.stage_run("rollout", parent, "ro-123", params={"n": 4}) as child:
        tracker.log_metrics(child, {"reward_mean": 0.25, "bad": float("nan")}, step=0)
    try:
        with tracker.stage_run("score", parent, "rw-456"):
            raise RuntimeError("judge down")
    except RuntimeError:
        pass
    tracker.end_run(parent)

    mlflow.set_tracking_uri(ws.settings.mlflow_uri)
    runs = mlflow.search_runs(experiment_ids=[tracker.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    by_stage = {r["tags.rlops.stage"]: r for _, r in runs.iterrows()}
    assert set(by_stage) == {"rollout", "score"}
    assert by_stage["rollout"]["tags.rlops.artifact_id"] == "ro-123"
    assert by_stage["rollout"]["metrics.reward_mean"] == 0.25
    assert by_stage["rollout"]["params.n"] == "4"
    assert by_stage["rollout"]["status"] == "FINISHED" and by_stage["score"]["status"] == "FAILED"
    top = mlflow.get_run(parent)
    assert top.data.params["grpo.lr"] == "0.0001" and top.data.tags["rlops.run_name"] == "nightly"
    assert ws.settings.mlflow_uri.startswith("sqlite:///") and (ws.root / "mlflow.db").exists()


def test_metric_names_mlflow_refuses_are_logged_under_a_safe_key(ws):
    """An evaluation with several samples reports "pass@4"; MLflow refuses "@" in a metric name, which used
    to fail the evaluate stage after its rollouts were scored."""
    tracker = ws.tracker
    parent = tracker.start_run("pipeline-sampled")
    tracker.log_metrics(parent, {"pass@4": 0.5, "heldout/pass@4": 0.25, "accuracy": 0.125}, step=3)
    tracker.end_run(parent)
    mlflow.set_tracking_uri(ws.settings.mlflow_uri)
    logged = mlflow.get_run(parent).data.metrics
    assert logged == {"pass_at_4": 0.5, "heldout/pass_at_4": 0.25, "accuracy": 0.125}


def test_new_workspaces_copy_one_empty_database_and_keep_their_own_runs(tmp_path, monkeypatch):
    """A new workspace's mlflow.db is a copy of an empty database made once per MLflow version in the cache
    (MLflow's migrations run once, not per workspace); each copy then holds only its own experiment and runs,
    and a database that already exists is opened, never replaced."""
    from storage.workspace import Workspace

    monkeypatch.setenv("RLOPS_CACHE", str(tmp_path / "cache"))
    template = tmp_path / "cache" / "mlflow" / f"empty-{mlflow.__version__}.db"
    first, second = Workspace.open(tmp_path / "a"), Workspace.open(tmp_path / "b")
    a = first.tracker.start_run("in-a")
    assert template.exists()
    made = template.stat().st_mtime_ns
    b = second.tracker.start_run("in-b")
    assert template.stat().st_mtime_ns == made  # the second workspace copied it: not made again
    for ws, mine, other in ((first, a, b), (second, b, a)):
        client = ws.tracker.client
        assert sorted(e.name for e in client.search_experiments()) == ["Default", "rlops"]
        found = {r.info.run_id for r in client.search_runs([ws.tracker.experiment_id])}
        assert found == {mine} and other not in found
        assert client.get_experiment(ws.tracker.experiment_id).artifact_location == (ws.root / "mlartifacts").as_uri()
    assert {r.info.run_id for r in Workspace.open(tmp_path / "a").tracker.client.search_runs(
        [first.tracker.experiment_id])} == {a}  # reopened, not overwritten by the copy
