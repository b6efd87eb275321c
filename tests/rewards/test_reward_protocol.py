"""The reward protocol: failures as data, one call per rollout, group rewards, totals, versions, light imports."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from rewards.base import (
    Outcome,
    RewardSpec,
    compute,
    fill_params,
    group_reward,
    reward,
    reward_version,
    total_version,
    weighted_total,
)
from storage.schema import Message

REWARD_FILE = '''\
import math
from rewards.base import reward, group_reward


@reward(low=0.0, high=1.0)
def by_answer(rollout, offset: float = 0.0):
    behaviour = rollout.metadata["behaviour"]
    if behaviour == "raise":
        raise RuntimeError("boom " + rollout.rollout_id)
    return {
        "ok": 0.5 + offset,
        "details": (0.25, {"why": "because"}),
        "nan": math.nan,
        "inf": math.inf,
        "string": "0.5",
        "none": None,
        "bool": True,
        "high": 1.5,
        "bad_details": (0.5, {"x": object()}),
        "nan_details": (0.5, {"x": math.nan}),
    }[behaviour]


@group_reward(low=0, high=10)
def ranks(group, fail_group: str = ""):
    if group[0].group_id == fail_group:
        raise ValueError("judge unavailable")
    return [float(r.sample_idx) for r in group]


@group_reward(low=0, high=1)
def short(group):
    return [0.0]


def undecorated(rollout):
    return 1.0
'''


@pytest.fixture
def reward_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARD_FILE)
    return path


def spec(path: Path, fn: str, **params) -> RewardSpec:
    return RewardSpec(fn=f"{path}:{fn}", params=params)


@pytest.mark.parametrize(
    "behaviour, value, error",
    [
        ("ok", 0.5, None),
        ("details", 0.25, None),
        ("raise", None, "RuntimeError: boom g0-0"),
        ("nan", None, "not finite"),
        ("inf", None, "not finite"),
        ("string", None, "expected a number, got str"),
        ("none", None, "expected a number, got NoneType"),
        ("bool", None, "expected a number, got bool"),
        ("high", None, "outside the declared range [0.0, 1.0]"),
        ("bad_details", None, "not JSON-serializable"),
        ("nan_details", None, "not JSON-serializable"),
    ],
)
def test_failures_are_data(reward_file, make_rollout, behaviour, value, error) -> None:
    [out] = compute(spec(reward_file, "by_answer"), [make_rollout([], {"behaviour": behaviour})])
    assert out.value == value
    if error is None:
        assert out.error is None
    else:
        assert error in out.error and "Traceback" not in out.error


def test_details_are_kept(reward_file, make_rollout) -> None:
    [out] = compute(spec(reward_file, "by_answer"), [make_rollout([], {"behaviour": "details"})])
    assert out == Outcome(0.25, {"why": "because"}, None)


def test_one_failure_does_not_stop_the_batch(reward_file, make_rollout) -> None:
    rollouts = [make_rollout([], {"behaviour": b}, sample_idx=i) for i, b in enumerate(["ok", "raise", "ok"])]
    outs = compute(spec(reward_file, "by_answer", offset=0.25), rollouts)
    assert [o.value for o in outs] == [0.75, None, 0.75]


@pytest.mark.parametrize("workers", [1, 4])
def test_compute_calls_each_reward_once_per_rollout(make_rollout, monkeypatch, workers) -> None:
    calls: list[object] = []  # list.append is atomic, so threads can share it

    @reward(low=0, high=1)
    def counted(rollout) -> float:
        calls.append(rollout.rollout_id)
        return 1.0

    @group_reward(low=0, high=10)
    def counted_group(group) -> list[float]:
        calls.append(tuple(r.rollout_id for r in group))
        return [float(r.sample_idx) for r in group]

    # Rewards are found by import path: put these two under a module name for the duration of the test.
    module = types.ModuleType("counted_rewards")
    module.counted, module.counted_group = counted, counted_group
    monkeypatch.setitem(sys.modules, "counted_rewards", module)
    rollouts = [make_rollout([], group_id=f"g{i % 3}", sample_idx=i) for i in range(9)]

    compute(RewardSpec(fn="counted_rewards.counted"), rollouts, workers=workers)
    assert sorted(calls) == sorted(r.rollout_id for r in rollouts)
    calls.clear()
    outs = compute(RewardSpec(fn="counted_rewards.counted_group"), rollouts, workers=workers)
    assert sorted(calls) == [tuple(r.rollout_id for r in rollouts if r.group_id == g) for g in ("g0", "g1", "g2")]
    assert [o.value for o in outs] == [float(i) for i in range(9)]  # mapped back to input order


def test_group_reward_failure_marks_the_group(reward_file, make_rollout) -> None:
    rollouts = [make_rollout([], group_id=g, sample_idx=i) for i, g in enumerate(["a", "b", "a", "b"])]
    outs = compute(spec(reward_file, "ranks", fail_group="b"), rollouts)
    assert [o.value for o in outs] == [0.0, None, 2.0, None]
    assert outs[1].error == "ValueError: judge unavailable"
    short = compute(spec(reward_file, "short"), rollouts[:2] + rollouts[2:3])
    assert short[0].value is None and "returned 1 values for 2 rollouts" in short[0].error


@pytest.mark.parametrize(
    "fn, params, message",
    [
        ("undecorated", {}, "not declared as a reward"),
        ("missing", {}, "cannot load reward"),
        ("by_answer", {"nope": 1}, "do not fit"),
    ],
)
def test_config_errors_raise_up_front(reward_file, make_rollout, fn, params, message) -> None:
    with pytest.raises(ValueError, match=message):
        compute(spec(reward_file, fn, **params), [make_rollout([], {"behaviour": "ok"})])


def test_spec_defaults_and_import_paths() -> None:
    assert RewardSpec(fn="rewards.builtin.exact_match").name == "exact_match"
    assert RewardSpec(fn="rewards.builtin:exact_match", name="em", weight=2).weight == 2.0
    assert reward_version(RewardSpec(fn="rewards.builtin.exact_match")) == reward_version(
        RewardSpec(fn="rewards.builtin:exact_match", name="other", weight=3.0)
    )


def test_fill_params_passes_context_only_where_taken() -> None:
    judge = RewardSpec(fn="rewards.ruler.ruler_reward", params={"model": "m"})
    assert fill_params(judge, cache_dir="/ws/cache/judge").params == {"model": "m", "cache_dir": "/ws/cache/judge"}
    mine = judge.model_copy(update={"params": {"model": "m", "cache_dir": "/mine"}})
    assert fill_params(mine, cache_dir="/ws/cache/judge").params["cache_dir"] == "/mine"
    assert fill_params(RewardSpec(fn="rewards.builtin.exact_match"), cache_dir="/x").params == {}
    assert reward_version(fill_params(judge, cache_dir="/x")) == reward_version(judge)  # unversioned


def test_weighted_total(make_rollout) -> None:
    specs = [RewardSpec(name="a", fn="rewards.builtin.exact_match", weight=2.0), RewardSpec(name="b", fn="rewards.builtin.length_penalty", weight=0.5)]
    a = [Outcome(1.0), Outcome(0.0), Outcome(None, None, "boom")]
    b = [Outcome(-0.5), Outcome(-1.0), Outcome(-0.2)]
    total = weighted_total(specs, [a, b])
    assert [t.value for t in total] == [1.75, -0.5, None]
    assert total[0].details == {"components": {"a": 1.0, "b": -0.5}}
    assert "a" in total[2].error
    with pytest.raises(ValueError, match="unique"):
        weighted_total([specs[0], specs[0]], [a, a])


def test_total_version_follows_components() -> None:
    a = RewardSpec(fn="rewards.builtin.exact_match")
    b = RewardSpec(fn="rewards.builtin.length_penalty", weight=0.1)
    base = total_version([a, b])
    assert total_version([a, b]) == base
    assert total_version([a, b.model_copy(update={"weight": 0.2})]) != base
    assert total_version([a, b.model_copy(update={"params": {"limit": 64}})]) != base
    assert total_version([a]) != base


def test_components_and_weighted_total(make_rollout) -> None:
    rollouts = [make_rollout([Message("assistant", "82")], {"answer": 82}, loss_mask=[1] * 256)]
    specs = [RewardSpec(fn="rewards.builtin.numeric_match"), RewardSpec(fn="rewards.builtin.length_penalty", weight=0.5)]
    components = [compute(s, rollouts) for s in specs]
    assert [c[0].value for c in components] == [1.0, -0.5]
    assert weighted_total(specs, components)[0].value == 0.75


@pytest.mark.parametrize("total, names", [("total", ["a", "a"]), ("a", ["a", "b"]), (None, ["a", "a"])])
def test_score_config_refuses_clashing_names(total: str | None, names: list[str]) -> None:
    # Two rewards (the total included) under one name would overwrite each other's rows.
    from stages.score import ScoreConfig, versions

    config = ScoreConfig(rewards=[RewardSpec(name=n, fn="rewards.builtin.exact_match") for n in names], total=total)
    with pytest.raises(ValueError, match="name"):
        versions(config)


# --- versions -------------------------------------------------------------------------------------

VERSIONED = textwrap.dedent(
    '''\
    from rewards.base import reward

    def helper():
        return 1

    @reward(low=0, high=1)
    def r(rollout, k: int = 1):
        return 1.0

    @reward(low=0, high=1, uses=(helper,))
    def with_helper(rollout):
        return float(helper())
    '''
)


def test_version_changes_with_source_and_params_only(tmp_path: Path) -> None:
    path = tmp_path / "versioned.py"
    path.write_text(VERSIONED)
    version = lambda **params: reward_version(RewardSpec(fn=f"{path}:r", params=params))  # noqa: E731
    v0 = version()
    assert version() == v0 and version(k=1) == v0  # explicit default == omitted
    assert version(k=2) != v0

    helped = reward_version(RewardSpec(fn=f"{path}:with_helper"))
    path.write_text(VERSIONED.replace("return 1\n", "return 2  # edited helper\n"))
    assert version() == v0  # unrelated code in the same module
    assert reward_version(RewardSpec(fn=f"{path}:with_helper")) != helped  # ...but an edit to a helper the reward calls does

    path.write_text(VERSIONED.replace("return 1.0", "return 0.0"))
    assert version() != v0  # the body

    path.write_text(VERSIONED.replace("high=1)", "high=2)"))
    assert version() != v0  # the declared range is part of the source


def test_uses_and_unversioned_params() -> None:
    judge = lambda **params: reward_version(RewardSpec(fn="rewards.ruler.ruler_reward", params={"model": "m", **params}))  # noqa: E731
    assert judge(cache_dir="/a", timeout=5, concurrency=9) == judge()  # operational params
    assert judge(rubric="be strict") != judge() and judge(permutations=2) != judge()


def test_rewards_import_without_heavy_packages() -> None:
    code = "import sys, rewards, rewards.builtin, rewards.ruler; print(sorted(m for m in ('torch', 'transformers', 'mlflow', 'prefect') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
