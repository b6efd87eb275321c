"""The resident policy (stages/policy/session.py): a run that keeps one model in memory computes exactly what
the same run computes stage by stage from files: the same artifact ids, metrics and adapter weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from flows import pipeline
from flows.run_config import from_dict
from stages.common import StageContext
from storage.workspace import Workspace
from tests.flows.conftest import tiny_config

TIMING = ("seconds", "tokens_per_s", "gen_seconds")  # wall-clock metrics differ between any two runs


def _config(model_dir: Path, **rollout: Any) -> dict[str, Any]:
    cfg = tiny_config(model_dir, name="res", steps=3)
    # SFT's LoRA keeps its default dropout (0.05): GRPO continues that adapter with dropout off either way.
    # A common stop string gives the random model's completions different lengths, so the length reward
    # varies within groups and every GRPO step trains.
    cfg["rollout"].update(group_size=4, max_new_tokens=8, temperature=1.0, stop=["e"], **rollout)
    cfg["eval"]["every"] = 2
    return cfg


def _run(tmp_path: Path, cfg: dict[str, Any], name: str, keep_resident: bool) -> tuple[Workspace, Any, list[dict]]:
    ws = Workspace.open(tmp_path / name)
    rows: list[dict] = []
    result = pipeline.train(from_dict(cfg), StageContext(ws, run_name="res"), on_step=rows.append,
                            keep_resident=keep_resident)
    return ws, result, rows


def _untimed(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if not any(t in k for t in TIMING)}


def _stage_metrics(ws: Workspace) -> list[dict[str, Any]]:
    """Every artifact's id, kind and recorded metrics (timing left out), in id order."""
    rows = ws.query("SELECT artifact_id, kind, meta FROM artifacts ORDER BY artifact_id").to_pylist()
    out = []
    for r in rows:
        meta = ws.catalog.get_artifact(r["artifact_id"])["meta"]
        out.append({"id": r["artifact_id"], "kind": r["kind"], "metrics": _untimed(meta.get("metrics", {}))})
    return out


def _adapters(ws: Workspace, policies: list[str]) -> list[dict[str, Any]]:
    return [load_file(str(Path(ws.catalog.get_checkpoint(p)["adapter_uri"]) / "adapter_model.safetensors"))
            for p in policies]


def test_resident_run_equals_stage_by_stage_from_files(tmp_path, tiny_model_dir, monkeypatch):
    import stages.policy.load
    import stages.update.train

    loads = {"generation": 0, "update": 0}
    load_policy, load_trainable = stages.policy.load.load_policy, stages.update.train._load_trainable

    def counted_policy(*a: Any, **k: Any) -> Any:
        loads["generation"] += 1
        return load_policy(*a, **k)

    def counted_trainable(*a: Any, **k: Any) -> Any:
        loads["update"] += 1
        return load_trainable(*a, **k)

    monkeypatch.setattr(stages.policy.load, "load_policy", counted_policy)
    monkeypatch.setattr(stages.update.train, "_load_trainable", counted_trainable)

    cfg = _config(tiny_model_dir)
    ws_files, files, files_rows = _run(tmp_path, cfg, "files", keep_resident=False)
    from_files = dict(loads)
    loads.update(generation=0, update=0)
    ws_res, res, res_rows = _run(tmp_path, cfg, "resident", keep_resident=True)

    # From files, every rollout and evaluation loads a model, and so does every update; resident, the
    # base weights are loaded once for the whole run (fp32 on CPU serves generation and updates).
    assert from_files == {"generation": 3 + 4, "update": 3}  # 3 training batches + 4 evaluations
    assert loads == {"generation": 1, "update": 0}

    assert (res.base, res.sft, res.policies, res.batches) == (files.base, files.sft, files.policies, files.batches)
    assert res.evals == files.evals
    assert [_untimed(r) for r in res_rows] == [_untimed(r) for r in files_rows]
    assert _stage_metrics(ws_res) == _stage_metrics(ws_files)
    # GRPO trained on something at every step (the length reward varies), and the weights agree exactly.
    trained = [ws_res.catalog.get_artifact(p)["meta"]["metrics"] for p in res.policies]
    assert all(m["tokens"] > 0 for m in trained)
    # On-policy with the SFT adapter (trained with dropout 0.05) resident too: the first pass's ratio is 1.
    assert trained[0]["first_pass_ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    for a, b in zip(_adapters(ws_res, res.policies), _adapters(ws_files, files.policies)):
        assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


@pytest.mark.slow
def test_resident_ray_actors_persist_and_match_in_process(tmp_path, tiny_model_dir, monkeypatch):
    """With `rollout.workers: 2` the run's actors are started once and get each new policy's LoRA
    weights from the driver; the batches equal a one-process run's (workers is operational)."""
    import ray

    import stages.rollout

    actors = stages.rollout._actors
    ids: list[set[str]] = []

    stats: list[dict[str, int]] = []

    def record(*a: Any, **k: Any) -> list[Any]:
        pool = actors(*a, **k)
        ids.append({x._actor_id.hex() for x in pool})
        stats.extend(ray.get([x.session_stats.remote() for x in pool]))  # before this batch's policy
        return pool

    monkeypatch.setattr(stages.rollout, "_actors", record)
    cfg = _config(tiny_model_dir, workers=2, groups_per_shard=1)
    cfg["sft"] = None
    try:
        _, res, res_rows = _run(tmp_path, cfg, "actors", keep_resident=True)
    finally:
        ray.shutdown()
    one = dict(cfg, rollout=dict(cfg["rollout"], workers=1))
    _, files, files_rows = _run(tmp_path, one, "one", keep_resident=False)

    # One pool for both training batches (evaluations, one shard of greedy episodes, run in this process).
    assert len(ids) == 3 and ids[0] == ids[1] == ids[2]
    # Seen before step 2's batch: each actor loaded its model once (step 0, the base policy), and step 1's
    # policy, trained in the driver, arrived as LoRA weights from memory, not from its checkpoint files.
    assert stats[4:] == [{"models": 1, "adapters_from_memory": 1, "adapters_from_files": 0}] * 2
    assert (res.policies, res.batches, res.evals) == (files.policies, files.batches, files.evals)
    assert [_untimed(r) for r in res_rows] == [_untimed(r) for r in files_rows]
