"""reasoning-gym as a task: every dataset builds, the dataset's own verifier scores through the reward,
splits are disjoint, the reward's version follows dataset, config and library, bad params fail before
compute, and a tiny model runs the pipeline on it end to end."""

from __future__ import annotations

import dataclasses
import json

import pytest
from reasoning_gym.factory import DATASETS

from flows import pipeline
from flows.config import ConfigError
from flows.run_config import load_run_config
from rewards.base import RewardSpec, compute, reward_version
from rewards.reach import reach
from rewards.reasoning_gym import extract_answer, score_answer
from stages.common import StageContext
from storage.schema import Message, Rollout
from storage.workspace import Workspace
from tasks.base import Prompt, TaskParamsError, load_task
from tasks.reasoning_gym import EVAL_SEED_OFFSET, make_task, write_oracle_dataset
from tests.flows.conftest import tiny_config
from tests.rewards.conftest import build_rollout

CHAIN = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
# Datasets whose entries have one right answer that their verifier scores 1.0, from several families.
ANSWERED = ["chain_sum", "basic_arithmetic", "letter_counting", "base_conversion", "gcd", "lcm",
            "word_sorting", "arc_agi"]  # arc_agi: its verifier compares tuples, which JSON would turn into lists


def rollout_for(prompt: Prompt, reply: str) -> Rollout:
    """A finished episode of `prompt` whose final reply is `reply`."""
    base = build_rollout([Message("assistant", reply)], metadata=prompt.metadata)
    return dataclasses.replace(base, messages=[Message("system", "s"), Message("user", prompt.question),
                                               Message("assistant", reply)], task="reasoning_gym")


def spec(dataset: str, config: dict | None = None) -> RewardSpec:
    return RewardSpec(name="correct", fn="rewards.reasoning_gym.score_answer",
                      params={"dataset": dataset, "config": config or {}})


@pytest.mark.parametrize("name", sorted(set(DATASETS) - {"composite"}))  # composite: a clear error, below
def test_every_registered_dataset_builds_a_task(name):
    task = make_task(dataset=name, size=2, eval_size=2)
    prompts = task.prompts("train") + task.prompts("test")
    assert prompts and all(p.question and p.metadata["dataset"] == name for p in prompts)
    json.dumps([p.metadata for p in prompts])  # metadata is stored as JSON


@pytest.mark.parametrize("name", ANSWERED)
def test_right_answers_score_one_and_wrong_ones_zero_through_the_reward(name):
    prompts = make_task(dataset=name, size=3, eval_size=1).prompts("train")
    right = [rollout_for(p, p.metadata["answer"]) for p in prompts]
    tagged = [rollout_for(p, f"Let me think.\n<answer> {p.metadata['answer']} </answer>") for p in prompts]
    wrong = [rollout_for(p, "<answer>certainly not this</answer>") for p in prompts]
    outcomes = compute(spec(name), right + tagged + wrong)
    assert [o.error for o in outcomes] == [None] * len(outcomes)
    assert [o.value for o in outcomes] == [1.0] * 6 + [0.0] * 3


def test_a_verifier_that_cannot_read_the_answer_scores_zero_with_its_reason():
    prompt = make_task(dataset="prime_factorization", size=1, eval_size=1).prompts("train")[0]
    [outcome] = compute(spec("prime_factorization"), [rollout_for(prompt, "no idea")])
    assert outcome.value == 0.0 and "ValueError" in outcome.details["verifier_error"]


def test_a_rollout_of_another_config_is_an_error_row_not_a_score():
    prompt = make_task(dataset="chain_sum", config=CHAIN, size=1, eval_size=1).prompts("train")[0]
    [outcome] = compute(spec("chain_sum", {**CHAIN, "max_digits": 2}), [rollout_for(prompt, prompt.metadata["answer"])])
    assert outcome.value is None and "give the reward the task's dataset and config, or neither" in outcome.error
    assert '"max_digits":1' in outcome.error and '"max_digits":2' in outcome.error  # both named


def test_without_params_the_reward_verifies_each_rollout_with_its_own_dataset():
    follow = RewardSpec(name="correct", fn="rewards.reasoning_gym.score_answer")
    rollouts = [rollout_for(p, p.metadata["answer"] if right else "<answer>certainly not this</answer>")
                for name, config in (("chain_sum", CHAIN), ("gcd", {}), ("word_sorting", {}))
                for p in make_task(dataset=name, config=config, size=2, eval_size=1).prompts("train")
                for right in (True, False)]
    assert [(o.value, o.error) for o in compute(follow, rollouts)] == [(1.0, None), (0.0, None)] * (len(rollouts) // 2)
    # A dataset given alone is checked, the config still follows the rollout.
    only_dataset = RewardSpec(name="correct", fn="rewards.reasoning_gym.score_answer", params={"dataset": "gcd"})
    outcomes = compute(only_dataset, rollouts)
    assert [o.error is None for o in outcomes] == [r.metadata["dataset"] == "gcd" for r in rollouts]


def test_answer_extraction():
    assert extract_answer("work\n<answer>1</answer> then <answer> 42 </answer>\n") == "42"
    assert extract_answer("  -7 \n") == "-7"
    assert extract_answer(None) is None


def test_splits_are_disjoint_seeded_and_the_test_split_ignores_size():
    task = make_task(dataset="chain_sum", config=CHAIN, size=300, eval_size=50)
    train, test = task.prompts("train"), task.prompts("test")
    # 1-digit two-term sums repeat: each split keeps a question once, and train drops the test's questions
    assert len({p.question for p in train}) == len(train) < 300
    assert not {p.question for p in train} & {p.question for p in test}
    assert {p.metadata["seed"] for p in test} == {EVAL_SEED_OFFSET}
    assert make_task(dataset="chain_sum", config=CHAIN, size=10, eval_size=50).prompts("test") == test
    assert make_task(dataset="chain_sum", config=CHAIN, size=300, eval_size=50, seed=1).prompts("train") != train


def test_reward_version_follows_dataset_config_and_library():
    base = reward_version(spec("chain_sum", CHAIN))
    assert reward_version(spec("chain_sum", CHAIN)) == base
    assert reward_version(spec("chain_sum", {**CHAIN, "max_digits": 2})) != base
    assert reward_version(spec("basic_arithmetic")) != reward_version(spec("chain_sum"))
    assert reach(score_answer).libraries["reasoning_gym"] == "0.1.25"  # the installed release enters the version


@pytest.mark.parametrize("params,expected", [
    ({"dataset": "chain_sums"}, "unknown reasoning-gym dataset 'chain_sums' (close names: chain_sum, decimal_chain_sum)"),
    ({"dataset": "chain_sum", "config": {"max_term": 3}}, "task.params.config.max_term: 'chain_sum' has no such config field"),
    ({"dataset": "chain_sum", "config": {"seed": 3}}, "task.params.config.seed: set task.params.seed instead"),
    ({"dataset": "chain_sum", "config": {"min_terms": 5, "max_terms": 2}}, "'chain_sum' rejects"),
    ({"dataset": "composite", "config": {}}, "'composite' (a weighted mix of datasets) is not supported"),
])
def test_bad_params_name_the_dataset_and_what_is_wrong(params, expected):
    with pytest.raises(TaskParamsError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        load_task("reasoning_gym", params)


def test_a_bad_dataset_is_a_config_error_before_any_compute(tmp_path):
    data = tiny_config(tmp_path / "no-model-needed")
    data["task"] = {"name": "reasoning_gym", "params": {"dataset": "chainsum"}}
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps(data))  # JSON is YAML
    with pytest.raises(ConfigError, match="task.params.dataset: unknown reasoning-gym dataset 'chainsum'"):
        load_run_config(path)


def test_the_shipped_config_follows_a_swapped_dataset_and_refuses_a_reward_of_another(tmp_path):
    # The issue a user hit: only task.params.dataset changed (and its config removed). The reward follows.
    cfg = load_run_config("configs/reasoning_gym.yaml", ["task.params.dataset=gcd", "task.params.config={}"])
    assert cfg.task.params["dataset"] == "gcd" and cfg.score.rewards[0].params == {}
    # A reward told another dataset or config than the task's is refused before any compute, naming both.
    with pytest.raises(ConfigError) as err:
        load_run_config("configs/reasoning_gym.yaml", [
            "task.params.dataset=gcd", "task.params.config={}",
            'score.rewards=[{name: correct, fn: rewards.reasoning_gym.score_answer, '
            'params: {dataset: chain_sum, config: {max_terms: 3}}}]'])
    assert 'score.rewards.correct: params.dataset is "chain_sum", but the task\'s is "gcd"' in str(err.value)
    assert 'score.rewards.correct: params.config is {"max_terms":3}, but the task\'s is {}' in str(err.value)


def test_oracle_demonstrations_follow_the_answer_format(tmp_path):
    n = write_oracle_dataset(tmp_path / "demo.jsonl", n=3, dataset="gcd", answer_format="tags")
    rows = [json.loads(line) for line in (tmp_path / "demo.jsonl").read_text().splitlines()]
    assert n == len(rows) == 3
    assert all(r["messages"][-1]["content"].startswith("<answer>") for r in rows)


def test_a_tiny_model_trains_on_a_swapped_reasoning_gym_dataset_end_to_end(tmp_path, tiny_model_dir):
    # The shipped config with its dataset swapped (gcd instead of chain_sum, no config), on a tiny model.
    cfg = load_run_config("configs/reasoning_gym.yaml", [
        f"base_model={tiny_model_dir}", "name=rg", "steps=1", "sft=null", "task.params.dataset=gcd",
        "task.params.config={}", "task.params.size=20", "task.params.eval_size=4", "rollout.prompts_per_step=2",
        "rollout.group_size=2", "rollout.max_new_tokens=4", "eval.n_prompts=4"])
    ws = Workspace.open(tmp_path / "ws")
    result = pipeline.train(cfg, StageContext(ws, run_name="rg"))
    assert len(result.policies) == 1
    rows = ws.query("SELECT r.task, r.metadata->>'dataset' AS dataset, w.value, w.error FROM rollouts r "
                    "JOIN rewards w USING (rollout_id) WHERE w.reward_name = 'correct'").to_pylist()
    assert len(rows) == 2 * 2 + 2 * 4  # one step's 2 groups of 2, and the held-out split before and after
    assert {(r["task"], r["dataset"]) for r in rows} == {("reasoning_gym", "gcd")}
    assert all(r["error"] is None and 0.0 <= r["value"] <= 1.0 for r in rows)
