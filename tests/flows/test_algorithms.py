"""The `algorithm:` selector: each name picks its own small config, configs without the key keep their
ids, a section of an unused algorithm is refused, and each algorithm runs one pipeline step."""

from __future__ import annotations


import pytest
import yaml

from flows import pipeline
from flows.algorithms import update_stage
from flows.config import ConfigError
from flows.run_config import from_dict
from stages import grpo, rollout, score
from stages.common import StageContext, base_policy, identity
from stages.update.config import GRPOConfig
from storage.ids import artifact_id
from storage.workspace import Workspace
from tests.flows.conftest import rlops_here, tiny_config


def test_no_algorithm_key_is_grpo_with_todays_id(tiny_model_dir):
    cfg = from_dict(tiny_config(tiny_model_dir))
    fn, config = update_stage(cfg)
    assert cfg.algorithm == "grpo" and fn is grpo.run and config is cfg.grpo
    # The id-bearing part of the update config is exactly what it was before the selector existed.
    assert identity(config) == identity(GRPOConfig())
    assert artifact_id("grpo", ["p"], identity(config)) == artifact_id("grpo", ["p"], identity(GRPOConfig()))


@pytest.mark.parametrize("algorithm, section, expected", [
    ("rloo", {"lr": 3e-4}, {"baseline": "rloo", "scale": "none", "lr": 3e-4, "skip_zero_variance": True}),
    ("reinforce_pp", {"epochs": 2}, {"baseline": "batch", "scale": "batch", "epochs": 2,
                                     "skip_zero_variance": False}),
])
def test_each_algorithm_has_its_own_small_config(tiny_model_dir, algorithm, section, expected):
    cfg = from_dict({**tiny_config(tiny_model_dir), "algorithm": algorithm, algorithm: section})
    fn, config = update_stage(cfg)
    assert fn is grpo.run and {k: getattr(config, k) for k in expected} == expected
    # and it is its own id: not GRPO's
    assert identity(config) != identity(GRPOConfig())


@pytest.mark.parametrize("data, message", [
    ({"algorithm": "rloo", "dpo": {"beta": 0.5}}, "algorithm is 'rloo', but the config sets dpo"),
    ({"reinforce_pp": {"lr": 1e-3}}, "set `algorithm: reinforce_pp`"),
    ({"algorithm": "rloo", "rloo": {"baseline": "mean"}}, "baseline"),  # not a knob of RLOO
    ({"algorithm": "a2c"}, "algorithm"),
])
def test_bad_algorithm_sections_are_refused(tiny_model_dir, data, message):
    with pytest.raises(ConfigError, match=message):
        from_dict({**tiny_config(tiny_model_dir), **data})


@pytest.mark.parametrize("algorithm", ["rloo", "reinforce_pp", "dpo", "ppo"])
def test_a_serialised_config_and_a_shipped_grpo_section_are_accepted(tiny_model_dir, algorithm):
    # flows hand configs to Prefect as model_dump(): every section present, at its defaults
    cfg = from_dict({**tiny_config(tiny_model_dir), "algorithm": algorithm, "grpo": {"lr": 3e-4}})
    assert from_dict(cfg.model_dump(mode="json")).algorithm == algorithm


@pytest.mark.slow
@pytest.mark.parametrize("algorithm, stage", [("rloo", "grpo"), ("reinforce_pp", "grpo"), ("dpo", "dpo"), ("ppo", "ppo")])
def test_each_algorithm_runs_one_pipeline_step(tmp_path, tiny_model_dir, algorithm, stage):
    cfg = from_dict({**tiny_config(tiny_model_dir, name=algorithm, steps=1), "sft": None, "eval": {"n_prompts": 1},
                     "algorithm": algorithm})
    ws = Workspace.open(tmp_path / "ws")
    result = pipeline.train(cfg, StageContext(ws, run_name=algorithm), on_step=lambda row: None)
    row = ws.catalog.get_checkpoint(result.final)
    assert row["parent_id"] == result.base and row["step"] == 1 and row["kind"] == stage
    assert [r["stage"] for r in ws.catalog.stage_runs(result.final)] == [stage]
    assert result.final in result.evals  # the final evaluation ran on the update's checkpoint


@pytest.mark.slow
def test_rlops_stage_dpo_prints_a_checkpoint_id(tmp_path, tiny_model_dir, capsys):
    cfg = tiny_config(tiny_model_dir, name="cli-dpo")
    ws = Workspace.open(tmp_path / "ws")
    ctx = StageContext(ws, run_name="cli-dpo")
    run_cfg = from_dict(cfg)
    batch = rollout.run(run_cfg.rollout, ctx, policy_id=base_policy(ws, str(tiny_model_dir)), task=run_cfg.task,
                        split="train", step=0)
    score.run(run_cfg.score, ctx, batches=[batch.id])
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = rlops_here(capsys, "stage", "dpo", str(path), "--policy", "base", "--rollouts", batch.id, "--reward",
                     "correct", "--set", "algorithm=dpo", "--set", "dpo.pairing=all", "--workspace", str(tmp_path / "ws"))
    policy = out.strip().splitlines()[-1]
    assert policy.startswith("ck-")
    row = Workspace.open(tmp_path / "ws").catalog.get_checkpoint(policy)
    assert row["kind"] == "dpo" and row["trained_on"]["batches"] == [batch.id]
    assert row["trained_on"]["reward"].startswith("correct@")
