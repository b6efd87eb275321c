"""Data and rewards as people bring them, through the pipeline on a tiny model: a JSONL of plain prompts, a
verl-layout Parquet with verl's compute_score, a `save_to_disk` dataset of conversations with TRL's own
rewards; then an edited TRL-style reward is rescored under a new version while the others are reused."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from flows import pipeline
from flows.run_config import from_dict
from stages.common import StageContext
from storage.workspace import Workspace
from tests.flows.conftest import tiny_config

QUESTIONS = [(f"What is {a} + {b}?", a + b) for a, b in zip(range(10, 34), range(40, 64))]
BREVITY = "def brevity(completions, **kwargs):\n    return [-len(c[0]['content']) / {scale} for c in completions]\n"


def config(tmp_path: Path, model_dir: Path, name: str, task: dict, rewards: list[dict]) -> dict:
    """The tiny pipeline config on `task`, one GRPO step, no SFT, a 2-prompt evaluation before and after."""
    cfg = tiny_config(model_dir, name=name, steps=1)
    cfg.update(task=task, sft=None, score={"rewards": rewards})
    cfg["eval"] = {"n_prompts": 2, "every": 1, "metric": rewards[0]["name"]}
    return cfg


def train(cfg: dict, ws: Workspace) -> pipeline.TrainResult:
    result = pipeline.train(from_dict(cfg), StageContext(ws, run_name=cfg["name"]), on_step=lambda row: None)
    assert len(result.policies) == 1
    return result


def rewards_of(ws: Workspace, name: str) -> list[dict]:
    return ws.query("SELECT w.value, w.error, w.reward_version, r.metadata FROM rewards w JOIN rollouts r USING "
                    "(rollout_id) WHERE w.reward_name = ? AND r.split = 'train'", [name]).to_pylist()


def test_a_jsonl_of_plain_prompts_trains_a_step_with_the_columns_in_rollout_metadata(tmp_path, tiny_model_dir):
    path = tmp_path / "plain.jsonl"
    path.write_text("".join(json.dumps({"question": q, "label": str(a), "topic": "sums"}) + "\n" for q, a in QUESTIONS))
    task = {"name": "dataset", "params": {"path": str(path), "prompt": "question", "answer": "label",
                                          "template": "{prompt} Reply with the number.", "test_fraction": 0.25}}
    cfg = config(tmp_path, tiny_model_dir, "plain", task, [
        {"name": "correct", "fn": "rewards.builtin.numeric_match"},
        {"name": "short", "fn": "rewards.builtin.length_penalty", "params": {"limit": 4}}])
    ws = Workspace.open(tmp_path / "ws")
    train(cfg, ws)
    rows = ws.query("SELECT r.task, r.messages, r.metadata->>'topic' AS topic, r.metadata->>'answer' AS answer "
                    "FROM rollouts r WHERE r.split = 'train'").to_pylist()
    assert len(rows) == 4 and {(r["task"], r["topic"]) for r in rows} == {("dataset", "sums")}
    assert all(r["messages"][0]["content"].endswith("? Reply with the number.") for r in rows)  # no system prompt
    assert all(r["error"] is None for r in rewards_of(ws, "correct"))


def test_a_verl_parquet_with_a_verl_compute_score_trains_a_step(tmp_path, tiny_model_dir):
    rows = [{"data_source": "sums", "prompt": [{"role": "user", "content": q}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(a)}, "extra_info": {"split": "train", "index": i}}
            for i, (q, a) in enumerate(QUESTIONS)]
    pq.write_table(pa.Table.from_pylist(rows[:20]), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[20:]), tmp_path / "test.parquet")
    (tmp_path / "score.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(ground_truth in solution_str) - len(solution_str) / 100, 'source': data_source}\n")
    task = {"name": "dataset", "params": {"path": str(tmp_path)}}  # train.parquet / test.parquet: split by name
    cfg = config(tmp_path, tiny_model_dir, "verl", task, [
        {"name": "verl", "fn": f"{tmp_path}/score.py:compute_score", "style": "verl"}])
    ws = Workspace.open(tmp_path / "ws")
    train(cfg, ws)
    scored = rewards_of(ws, "verl")
    assert len(scored) == 4 and all(r["error"] is None for r in scored)
    assert {json.loads(r["metadata"])["reward_model"]["style"] for r in scored} == {"rule"}
    details = ws.query("SELECT DISTINCT details->>'source' AS s FROM rewards WHERE reward_name = 'verl'").to_pylist()
    assert details == [{"s": "sums"}]


def test_trl_rewards_train_a_step_on_a_saved_dataset_and_an_edited_one_is_rescored_alone(tmp_path, tiny_model_dir):
    import datasets

    rows = [{"prompt": [{"role": "system", "content": "Think, then answer in \\boxed{}."},
                        {"role": "user", "content": q}], "solution": str(a)} for q, a in QUESTIONS]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:20]),
                          "test": datasets.Dataset.from_list(rows[20:])}).save_to_disk(str(tmp_path / "saved"))
    reward_file = tmp_path / "my_rewards.py"
    reward_file.write_text(BREVITY.format(scale=100))
    cfg = config(tmp_path, tiny_model_dir, "trl", {"name": "dataset", "params": {"path": str(tmp_path / "saved")}}, [
        {"name": "accuracy", "fn": "trl.rewards.accuracy_reward", "style": "trl"},
        {"name": "think", "fn": "trl.rewards.think_format_reward", "style": "trl", "weight": 0.5},
        {"name": "brevity", "fn": f"{reward_file}:brevity", "style": "trl", "weight": 0.1}])
    ws = Workspace.open(tmp_path / "ws")
    result = train(cfg, ws)
    for name in ("accuracy", "think", "brevity", "total"):
        scored = rewards_of(ws, name)
        assert len(scored) == 4 and all(r["error"] is None and r["value"] is not None for r in scored), name
    trained = ws.catalog.get_artifact(result.policies[0])["meta"]["metrics"]
    assert trained["frac_zero_variance_groups"] < 1.0  # brevity differs within a group: the step had signal

    before = {n: rewards_of(ws, n)[0]["reward_version"] for n in ("accuracy", "think", "brevity", "total")}
    reward_file.write_text(BREVITY.format(scale=10))
    parts = pipeline.rescore(from_dict(cfg), StageContext(ws, run_name="rescore"), "trl")
    after = ws.catalog.get_artifact(parts[0].id)["meta"]["rewards"]
    assert after["accuracy"] == before["accuracy"] and after["think"] == before["think"]  # found, not recomputed
    assert after["brevity"] != before["brevity"] and after["total"] != before["total"]
    versions = ws.query("SELECT reward_name, count(DISTINCT reward_version) AS n FROM rewards r JOIN rollouts o "
                        "USING (rollout_id) WHERE o.split = 'train' GROUP BY ALL ORDER BY 1").to_pylist()
    assert versions == [{"reward_name": "accuracy", "n": 1}, {"reward_name": "brevity", "n": 2},
                        {"reward_name": "think", "n": 1}, {"reward_name": "total", "n": 2}]
    old, new = (sorted(r["value"] for r in rewards_of(ws, "brevity") if r["reward_version"] == v)
                for v in (before["brevity"], after["brevity"]))
    assert [round(10 * o, 9) for o in old] == [round(n, 9) for n in new]  # the edit is what changed the values
