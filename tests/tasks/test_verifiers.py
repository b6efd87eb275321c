"""`task: verifiers` below the pipeline: faults of an environment are error rows naming it and the turn (a hang
within its timeout), and the versions split as rlops' promise needs: editing a rubric function changes that
reward's version only (the stored rollouts are rescored, not regenerated), editing the environment's own code
changes the rollout batch id."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from flows.run_config import ConfigError, from_dict
from rewards.base import RewardSpec, reward_version
from rewards.verifiers import expand
from stages import rollout
from stages.common import StageContext, base_policy
from storage.schema import Rollout, from_table
from storage.workspace import Workspace
from tasks.base import load_task

ENVS = Path(__file__).resolve().parent / "verifiers_envs_for_tests.py"
ARITH = Path(__file__).resolve().parents[2] / "examples" / "verifiers_arith" / "arith_env.py"


@pytest.mark.parametrize("fault, reason", [
    ("raise", "RuntimeError: the game server is down"),
    ("malformed", "TypeError: 'int' object is not iterable"),
    ("hang", "ran over 3 s at turn 2 (after 1 model call(s))"),
])
def test_a_failing_environment_is_an_error_row_naming_it_and_the_turn(tmp_path, tiny_model_dir, fault, reason):
    ws = Workspace.open(tmp_path / "ws")
    task = rollout.TaskSpec(name="verifiers", params={"env": str(ENVS), "env_args": {"fault": fault},
                                                      "episode_timeout": 3, "max_error_frac": 1.0})
    config = rollout.RolloutConfig(prompts_per_step=1, group_size=2, max_new_tokens=4, max_total_tokens=512)
    started = time.monotonic()
    ref = rollout.run(config, StageContext(ws), base_policy(ws, str(tiny_model_dir)), task)
    assert time.monotonic() - started < 60  # the hung episodes were given up on at 3 s, in parallel
    rows = from_table(ws.read_artifact(ref.id), Rollout)
    assert len(rows) == 2
    for r in rows:
        error = r.metadata.get("error") or ""
        assert r.finish_reason == "error" and r.token_ids == [], error
        assert f"verifiers {ENVS}" in error and "episode" in error and reason in error, error
        if fault != "hang":
            assert ", turn 1:" in error  # the model had answered once; the environment failed on its reply


def test_editing_a_rubric_function_rescores_and_editing_the_env_regenerates(tmp_path):
    env = tmp_path / "arith_env.py"
    shutil.copy(ARITH, env)

    def ids() -> tuple[str, dict[str, str]]:
        task = load_task("verifiers", {"env": str(env), "env_args": {"n_train": 4, "n_eval": 2}})
        specs = expand([{"fn": "rewards.verifiers.functions"}], str(env), {"n_train": 4, "n_eval": 2})
        return task.agent.version, {s["name"]: reward_version(RewardSpec(**s)) for s in specs}

    task0, rewards0 = ids()
    env.write_text(env.read_text().replace('re.fullmatch(r"\\s*-?\\d+\\s*"', 're.fullmatch(r"\\s*\\d+\\s*"'))
    task1, rewards1 = ids()
    assert task1 == task0  # the episodes do not depend on a reward function: the stored rollouts stand
    assert rewards1["number_only"] != rewards0["number_only"]
    assert rewards1["correct_answer"] == rewards0["correct_answer"] and rewards1["num_turns"] == rewards0["num_turns"]
    # a helper a reward reaches is part of that reward's version
    env.write_text(env.read_text().replace('found = re.findall(r"-?\\d+"', 'found = re.findall(r"\\d+"'))
    task2, rewards2 = ids()
    assert rewards2["correct_answer"] != rewards1["correct_answer"] and rewards2["number_only"] == rewards1["number_only"]
    env.write_text(env.read_text().replace("Reply with the number only", "Reply with the sum only"))
    task3, _ = ids()
    assert task3 != task2  # the environment's own code (its system prompt) changed: new episodes


def test_the_rubric_as_one_reward_and_config_errors():
    base = {"name": "vf", "task": {"name": "verifiers", "params": {"env": str(ENVS), "env_args": {"kind": "guess"}}},
            "score": {"rewards": [{"name": "rubric", "fn": "rewards.verifiers.rubric"}]}}
    cfg = from_dict(base)
    assert cfg.score.rewards[0].params == {"env": str(ENVS), "env_args": {"kind": "guess"}}
    bad = {**base, "score": {"rewards": [{"fn": "rewards.verifiers.function", "params": {"function": "nope"}}]}}
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        from flows.run_config import semantic_problems

        problems = semantic_problems(from_dict(bad))
        raise ConfigError("; ".join(problems))
    with pytest.raises(ValueError, match="verifiers environment file not found"):
        load_task("verifiers", {"env": "no/such/env.py"})
