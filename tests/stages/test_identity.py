"""Artifact identity decided once: operational fields stay out of ids, a base model is identified by its
content, task data by its rows, reward references resolve one way, and SQL takes names as data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flows import pipeline
from flows.run_config import EvalSection
from stages import rollout
from stages.common import StageContext, base_policy, identity
from stages.evaluate import EvalConfig
from stages.policy import model as model_module
from stages.reward_ref import RewardRef
from stages.score import ScoreConfig
from stages.update.config import GRPOConfig
from storage.schema import RewardRow, to_table
from storage.workspace import Workspace


def test_operational_fields_never_enter_ids() -> None:
    assert identity(rollout.RolloutConfig(workers=4, groups_per_shard=1)) == identity(
        rollout.RolloutConfig())
    assert identity(GRPOConfig(activation_checkpointing=False, workers=2)) == identity(GRPOConfig())
    assert identity(ScoreConfig(rewards=[{"fn": "rewards.builtin.exact_match"}], workers=8)) == identity(
        ScoreConfig(rewards=[{"fn": "rewards.builtin.exact_match"}]))
    # `every` is a pipeline setting: an evaluation's id is the same whatever it is
    assert identity(EvalSection(every=1)) == identity(EvalSection(every=7)) == identity(EvalConfig())
    # ... and everything that changes results does change the id-bearing part
    assert identity(rollout.RolloutConfig(temperature=0.7)) != identity(rollout.RolloutConfig())
    assert identity(GRPOConfig(micro_batch_size=4)) != identity(GRPOConfig())
    assert "temperature" not in GRPOConfig.model_fields  # the rollouts record it; asked once


def test_added_fields_enter_ids_only_off_their_default() -> None:
    # skip_zero_variance came after GRPO ids existed: at its default (the old behaviour) ids are unchanged.
    assert "skip_zero_variance" not in identity(GRPOConfig())
    assert identity(GRPOConfig(skip_zero_variance=True)) == identity(GRPOConfig())
    assert identity(GRPOConfig(skip_zero_variance=False))["skip_zero_variance"] is False


def test_base_policy_follows_the_weights_not_the_name(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("RLOPS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    ws = Workspace.open(tmp_path / "ws")

    hashed: list[str] = []
    real = model_module._file_sha256
    monkeypatch.setattr(model_module, "_file_sha256", lambda p: hashed.append(p.name) or real(p))
    first = base_policy(ws, str(folder))
    assert "model.safetensors" in hashed and "config.json" in hashed
    hashed.clear()
    assert base_policy(ws, str(folder)) == first and hashed == []  # cached by path + size + mtime

    # same folder name, other weights: a new base policy (and so new ids for all that comes from it)
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 1.0
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    second = base_policy(ws, str(folder))
    assert second != first and hashed == ["model.safetensors"]  # only the changed file is hashed again
    assert ws.catalog.get_checkpoint(second)["trained_on"]["fingerprint"] == model_module.fingerprint(str(folder))
    assert torch.is_tensor(weights[name])


def test_hub_ids_have_no_fingerprint(monkeypatch) -> None:
    assert model_module.fingerprint("some-org/not-a-local-folder") is None


def test_changed_rows_under_the_same_prompt_ids_give_new_rollouts(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = tmp_path / "sums.jsonl"
    rows = [{"question": f"What is {i} + {i}?", "answer": 2 * i, "split": "train"} for i in range(1, 4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = rollout.TaskSpec(name="arithmetic", params={"data_file": str(data)})
    config = rollout.RolloutConfig(prompts_per_step=1, group_size=2, max_new_tokens=4, max_total_tokens=128)
    ws = Workspace.open(tmp_path / "ws")
    ctx = StageContext(ws, run_name="t")
    policy = base_policy(ws, str(tiny_model_dir))
    first = rollout.run(config, ctx, policy, task)
    assert rollout.run(config, ctx, policy, task).cached

    rows[0]["answer"] = 99  # same question, so the same prompt id; other ground truth
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    second = rollout.run(config, ctx, policy, task)
    assert second.id != first.id and not second.cached
    assert ws.read_artifact(second.id)["metadata"].to_pylist()[0] == json.dumps({"answer": 99})


def test_reward_refs_parse_and_resolve(tmp_path: Path) -> None:
    assert RewardRef.parse("correct") == RewardRef("correct")
    assert str(RewardRef.parse("correct@abc")) == "correct@abc"
    for bad in ("", "@abc", "correct@", "a@b@c"):
        with pytest.raises(ValueError, match="NAME"):
            RewardRef.parse(bad)

    ws = Workspace.open(tmp_path / "ws")
    for part, (batch, version) in enumerate([("ro-a", "v1"), ("ro-b", "v1"), ("ro-a", "v2")]):
        rows = [RewardRow(f"{batch}-0", batch, "correct", version, 1.0, {}, None, f"rw-{part}")]
        ws.write_part("rewards", f"rw-{part}", to_table(rows), part="part-0")
        ws.catalog.complete_artifact(f"rw-{part}", "rewards", "score", [batch], "cfg")
    # v2 is newer but only on ro-a: the newest version scored on *all* batches is v1
    assert RewardRef("correct").resolve(ws, ["ro-a", "ro-b"]) == RewardRef("correct", "v1")
    assert RewardRef("correct").resolve(ws, ["ro-a"]) == RewardRef("correct", "v2")
    assert RewardRef("correct", "v9").resolve(ws, ["ro-a"]).version == "v9"  # given: kept as is
    with pytest.raises(KeyError, match="score stage"):
        RewardRef("style").resolve(ws, ["ro-a"])


def test_a_quote_in_a_run_name_is_data(tmp_path: Path, tiny_model_dir: Path) -> None:
    ws = Workspace.open(tmp_path / "ws")
    name = "o'brien's run"
    ctx = StageContext(ws, run_name=name)
    task = rollout.TaskSpec(name="arithmetic", params={"n_train": 20, "n_test": 5})
    config = rollout.RolloutConfig(prompts_per_step=2, group_size=2, max_new_tokens=4, max_total_tokens=128)
    batch = rollout.run(config, ctx, base_policy(ws, str(tiny_model_dir)), task)
    assert pipeline.run_batches(ctx, name) == [batch.id]
    with pytest.raises(KeyError, match="no training rollout batches"):
        pipeline.run_batches(ctx, "o'brien")  # a prefix of the name matches nothing
    used = ws.query("SELECT DISTINCT prompt_id FROM rollouts WHERE batch_id = ?", [batch.id]).to_pylist()
    cfg = pipeline.RunConfig.model_validate({
        "name": "x", "base_model": str(tiny_model_dir), "task": task.model_dump(), "rollout": {"prompts_per_step": 2},
        "score": {"rewards": [{"fn": "rewards.builtin.numeric_match"}]}})
    unseen = pipeline.unseen_prompts(cfg, ctx, 2)
    assert unseen is not None and not {r["prompt_id"] for r in used} & set(unseen)
