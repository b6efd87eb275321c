"""Dynamic sampling (DAPO): extra rollout batches when a step's groups carry no signal, all trained on,
found again on a rerun, replayed together by retrain."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flows import pipeline
from flows.run_config import from_dict
from stages.common import StageContext
from stages.reward_ref import RewardRef
from stages.update.data import informative_groups
from storage.workspace import Workspace
from tests.flows.conftest import tiny_config


def _config(model_dir: Path, train_reward: str, **ds: Any) -> dict[str, Any]:
    cfg = tiny_config(model_dir, name="ds", steps=2)
    cfg.update(sft=None, train_reward=train_reward, dynamic_sampling={"enabled": True, **ds})
    # A common stop string gives the random model's completions different lengths: `short` varies within
    # groups, while `correct` (the random model never answers a sum) is 0 everywhere.
    cfg["rollout"].update(group_size=4, max_new_tokens=8, stop=["e"])
    cfg["eval"]["every"] = 2
    return cfg


def test_uninformative_steps_sample_more_batches_and_train_on_all(tmp_path: Path, tiny_model_dir: Path) -> None:
    cfg = from_dict(_config(tiny_model_dir, "correct", max_batches=3))
    ws = Workspace.open(tmp_path / "ws")
    ctx = StageContext(ws, run_name="ds")
    rows: list[dict] = []
    result = pipeline.train(cfg, ctx, on_step=rows.append)

    steps = pipeline.step_batches(ctx, "ds")
    assert [len(b) for b in steps] == [3, 3]  # no group ever informative: max_batches per step
    reward = RewardRef.configured(cfg.score, "correct")
    assert all(informative_groups(ws, b, reward) == 0 for b in steps)
    prompts = [{p["prompt_id"] for p in ws.query("SELECT DISTINCT prompt_id FROM rollouts WHERE batch_id = ?", [b]
                                                  ).to_pylist()} for b in steps[0]]
    assert len(set.union(*prompts)) > len(prompts[0])  # the extra batches drew other prompts
    for policy, batches in zip(result.policies, steps):
        assert sorted(ws.catalog.get_checkpoint(policy)["trained_on"]["batches"]) == sorted(batches)
    assert [r["batches"] for r in rows if "step" in r] == [3, 3]

    again = pipeline.train(cfg, ctx, on_step=lambda r: None)  # a rerun finds every batch: nothing new
    assert again.policies == result.policies and again.batches == result.batches
    # Retrain replays each step's batches together: from the same parent, the same checkpoints.
    assert pipeline.retrain(cfg, StageContext(ws, run_name="ds-again"), result.base, "ds") == result.policies


def test_informative_steps_need_no_more_batches(tmp_path: Path, tiny_model_dir: Path) -> None:
    cfg = from_dict(_config(tiny_model_dir, "short", min_groups=1))
    ws = Workspace.open(tmp_path / "ws")
    ctx = StageContext(ws, run_name="ds")
    pipeline.train(cfg, ctx, on_step=lambda r: None)
    steps = pipeline.step_batches(ctx, "ds")
    assert [len(b) for b in steps] == [1, 1]
    reward = RewardRef.configured(cfg.score, "short")
    assert all(informative_groups(ws, b, reward) >= 1 for b in steps)
