"""Configs are validated as a whole before any compute; every problem is listed in one message."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from flows.config import ConfigError, apply_overrides
from flows.run_config import load_run_config

GOOD = {
    "name": "t",
    "task": {"name": "arithmetic", "params": {"n_train": 20, "n_test": 5}},
    "steps": 2,
    "score": {"rewards": [{"name": "correct", "fn": "rewards.builtin.numeric_match"}]},
}


def _write(tmp_path: Path, data) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def _with(**changes):
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    for dotted, value in changes.items():
        node = data
        *parents, leaf = dotted.split("__")
        for k in parents:
            node = node.setdefault(k, {})
        if value is KeyError:
            node.pop(leaf)
        else:
            node[leaf] = value
    return data


# Configs whose data files an example script writes: the script, its size flags, and the overrides pointing there.
MADE_DATA = {
    "dataset_math.yaml": ("examples/dataset_math/make_dataset.py", ["--train", "20", "--test", "5", "--sft", "4"],
                          lambda out: [f"task.params.files={{train: {out}/train.parquet, test: {out}/test.parquet}}",
                                       f"sft.data={out}/sft.jsonl"]),
    "code.yaml": ("examples/code/make_dataset.py", ["--train", "20", "--test", "5"],
                  lambda out: [f"task.params.files={{train: {out}/train.jsonl, test: {out}/test.jsonl}}"]),
}


def made_data(config: str, out: Path) -> list[str]:
    """Run the example script that writes `config`'s data into `out`; the overrides that point the config there."""
    script, flags, overrides = MADE_DATA[config]
    subprocess.run([sys.executable, script, "--out", str(out), *flags], check=True, capture_output=True)
    return overrides(out)


def test_the_shipped_configs_and_a_minimal_one_are_valid(tmp_path, tiny_vlm_dir):
    # visual.yaml names the user's VLM folder, visual_learn.yaml the one `make small-vlm` builds in $RLOPS_CACHE:
    # both are checked with a stand-in folder, and with none each names the folder (and what builds it).
    visual = {"visual.yaml", "visual_learn.yaml"}
    for path in Path("configs").glob("*.yaml"):
        overrides = [f"base_model={tiny_vlm_dir}"] if path.name in visual else []
        if path.name in MADE_DATA:  # data an example script writes (gitignored): made here, as a user would
            overrides += made_data(path.name, tmp_path / path.stem)
        load_run_config(path, overrides)
    with pytest.raises(ConfigError, match=r"\(1 problem\):\n  - base_model: folder not found: ./models/your-vlm$"):
        load_run_config("configs/visual.yaml")
    cache = Path(os.environ["RLOPS_CACHE"])  # the suite's own (tests/conftest.py): `make small-vlm` never ran there
    with pytest.raises(ConfigError, match=r"\(1 problem\):\n  - base_model: folder not found: "
                       + re.escape(f"{cache}/models/SmolVLM-SmolLM2-135M-shapes (`make small-vlm` builds it there")):
        load_run_config("configs/visual_learn.yaml")
    cfg = load_run_config(_write(tmp_path, GOOD), ["steps=3", "grpo.lr=5e-5", "rollout.stop=[x, y]"])
    assert cfg.steps == 3 and cfg.grpo.lr == 5e-5 and cfg.rollout.stop == ["x", "y"]


INVALID = [
    ("unknown top-level key", _with(stpes=3), ["stpes: unknown key"]),
    ("unknown nested key", _with(grpo__learning_rate=1e-4), ["grpo.learning_rate: unknown key"]),
    ("wrong type", _with(steps="many"), ["steps:"]),
    ("negative", _with(rollout__group_size=0), ["rollout.group_size:"]),
    ("bad literal", _with(grpo__aggregation="mean"), ["grpo.aggregation:"]),
    ("missing section", _with(score=KeyError), ["score: Field required"]),
    ("several problems at once", _with(steps=-1, rollout__temperature="hot", eval__oops=1),
     ["steps:", "rollout.temperature:", "eval.oops: unknown key"]),
    ("unknown task", _with(task__name="no_such_task"), ["task: cannot load 'no_such_task'"]),
    ("bad task params", _with(task__params={"digits": 0}), ["task: cannot load 'arithmetic'"]),
    ("reward not importable", _with(score__rewards=[{"fn": "rewards.builtin.nope"}]), ["score.rewards.nope: cannot load reward", "nope"]),
    ("reward params it does not take", _with(score__rewards=[{"fn": "rewards.builtin.numeric_match", "params": {"x": 1}}]),
     ["score.rewards.numeric_match: params ['x'] do not fit"]),
    ("train reward not scored", _with(train_reward="style"), ["train_reward: 'style' is not one of"]),
    ("grpo temperature (the rollouts record theirs)", _with(grpo__temperature=0.7), ["grpo.temperature"]),
    ("sft data missing", _with(sft={"data": "/nonexistent/demos.jsonl"}), ["sft.data: file not found"]),
    ("bad run name", _with(name="my run!"), ["name:"]),
    ("distillation teacher missing", _with(grpo__distill={"teacher": "/nonexistent/teacher"}),
     ["grpo.distill.teacher: folder not found"]),
    ("curriculum and replay keys", _with(curriculum={"skip_solvd": 2}, replay={"max_age": 0}),
     ["curriculum.skip_solvd: unknown key", "replay.max_age:"]),
]


@pytest.mark.parametrize("label,data,expected", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_configs_list_every_problem(tmp_path, label, data, expected):
    with pytest.raises(ConfigError) as err:
        load_run_config(_write(tmp_path, data))
    for fragment in expected:
        assert fragment in str(err.value), str(err.value)


@pytest.mark.parametrize("text,expected", [
    ("name: [unclosed", "not valid YAML"),
    ("- a\n- b\n", "top level must be a mapping"),
])
def test_unreadable_files(tmp_path, text, expected):
    with pytest.raises(ConfigError, match=expected):
        load_run_config(_write(tmp_path, text))
    with pytest.raises(ConfigError, match="config file not found"):
        load_run_config(tmp_path / "missing.yaml")


def test_overrides():
    assert apply_overrides({"a": {"b": 1}}, ["a.b=2", "a.c=true", "d=[1, 2]", "e=x=y"]) == \
        {"a": {"b": 2, "c": True}, "d": [1, 2], "e": "x=y"}
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        apply_overrides({}, ["novalue"])
    with pytest.raises(ConfigError, match="'a' is not a section"):
        apply_overrides({"a": 1}, ["a.b=2"])


def test_cli_rejects_a_bad_config_before_any_compute(tmp_path):
    cfg = _write(tmp_path, _with(steps="many", grpo__lr="fast"))
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(cfg), "--workspace", str(tmp_path / "ws"),
                          "--set", "rollout.workers=0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "3 problems" in out.stderr and "steps:" in out.stderr and "grpo.lr:" in out.stderr
    assert "rollout.workers:" in out.stderr
    assert not (tmp_path / "ws").exists()  # nothing was created, let alone computed
    assert time.perf_counter() - t0 < 60


def test_checking_a_config_and_reading_a_runs_batches_import_no_training_stack():
    """A config check (and `rlops inspect`, which reads a run's batches through flows.pipeline) loads none of
    torch, transformers, peft, Ray, vLLM: they cost seconds of CPU per command (torch came in through PPO's
    config importing its credit type from the GAE code)."""
    code = ("import sys; from flows.run_config import load_run_config; import flows.pipeline; "
            "load_run_config('configs/arithmetic.yaml', []); "
            "print(sorted(m for m in ('torch', 'transformers', 'peft', 'ray', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
