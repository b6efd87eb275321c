"""Score stage on a real workspace: versioned reward parts, rescoring, failures as data."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from rewards.base import RewardSpec
from stages import score
from stages.common import StageContext
from tests.storage.conftest import add_batch, ws  # noqa: F401 - the ws fixture

CUSTOM = textwrap.dedent('''
    import os
    from rewards.base import reward

    @reward(low=0.0, high=1.0)
    def long_answer(rollout, min_chars: int = 3):
        with open(os.environ["RLOPS_TEST_COUNT_FILE"], "a") as f:
            f.write(rollout.rollout_id + "\\n")
        return float(len(rollout.messages[-1].content or "") >= min_chars)

    @reward(low=0.0, high=1.0)
    def flaky(rollout):
        if rollout.sample_idx == 0:
            raise RuntimeError("judge unreachable")
        return 2.0 if rollout.sample_idx == 1 else 1.0  # 2.0 is out of range: an error row too
''')


@pytest.fixture
def env(ws, tmp_path, monkeypatch):
    reward_file = tmp_path / "my_rewards.py"
    reward_file.write_text(CUSTOM)
    counter = tmp_path / "calls.txt"
    counter.touch()
    monkeypatch.setenv("RLOPS_TEST_COUNT_FILE", str(counter))
    ws_batch = "ro-s"
    add_batch(ws, ws_batch, groups=2, size=4, reward_version=None)
    return ws, StageContext(ws, run_name="t"), reward_file, counter, ws_batch


def _config(reward_file: Path, extra: list[RewardSpec] | None = None, **kw) -> score.ScoreConfig:
    rewards = [RewardSpec(fn="rewards.builtin.exact_match", weight=1.0),
               RewardSpec(fn=f"{reward_file}:long_answer", weight=0.5)] + (extra or [])
    return score.ScoreConfig(rewards=rewards, **kw)


def _calls(counter: Path) -> int:
    return len(counter.read_text().split())


def test_scores_every_reward_and_the_weighted_total(env):
    ws, ctx, reward_file, counter, batch = env
    ref = score.run(_config(reward_file), ctx, [batch])
    assert ref.id.startswith("rs-") and not ref.cached
    rows = ws.query("SELECT reward_name, count(*) AS n, sum(value) AS s, count(error) AS e FROM rewards "
                    "JOIN rollouts USING (rollout_id) GROUP BY 1 ORDER BY 1").to_pylist()
    # tests.factories: odd samples answer "1987" (correct, 4 chars), even ones "no idea" (7 chars)
    assert rows == [{"reward_name": "exact_match", "n": 8, "s": 4.0, "e": 0},
                    {"reward_name": "long_answer", "n": 8, "s": 8.0, "e": 0},
                    {"reward_name": "total", "n": 8, "s": 4.0 + 0.5 * 8, "e": 0}]
    assert _calls(counter) == 8
    meta = ws.catalog.get_artifact(ref.id)["meta"]
    assert set(meta["rewards"]) == {"exact_match", "long_answer", "total"}
    assert meta["metrics"]["total.mean"] == pytest.approx(1.0)


def test_rescoring_unchanged_rewards_computes_nothing(env):
    ws, ctx, reward_file, counter, batch = env
    first = score.run(_config(reward_file), ctx, [batch])
    again = score.run(_config(reward_file), ctx, [batch])
    assert again.id == first.id and again.cached
    assert _calls(counter) == 8
    assert ws.query("SELECT count(*) AS n FROM rewards").to_pylist() == [{"n": 24}]


def test_after_an_edit_only_the_edited_reward_is_recomputed(env):
    ws, ctx, reward_file, counter, batch = env
    first = score.run(_config(reward_file), ctx, [batch])
    v1 = score.versions(_config(reward_file))
    reward_file.write_text(CUSTOM.replace("len(rollout.messages[-1].content or \"\") >= min_chars",
                                          "len(rollout.messages[-1].content or \"\") >= min_chars + 2"))
    v2 = score.versions(_config(reward_file))
    assert v2["exact_match"] == v1["exact_match"]
    assert v2["long_answer"] != v1["long_answer"] and v2["total"] != v1["total"]

    second = score.run(_config(reward_file), ctx, [batch])
    assert second.id != first.id
    assert _calls(counter) == 16  # long_answer ran once more per rollout; exact_match did not run again
    rows = ws.query("SELECT reward_name, reward_version, sum(value) AS s FROM rewards GROUP BY ALL ORDER BY 1, 2").to_pylist()
    by = {(r["reward_name"], r["reward_version"]): r["s"] for r in rows}
    assert len(by) == 5  # exact_match once, long_answer x2, total x2
    assert by[("long_answer", v2["long_answer"])] == 4.0  # "no idea" still >= 5 chars, "1987" no longer
    assert by[("total", v2["total"])] == 4.0 + 0.5 * 4


def test_failures_are_rows_and_too_many_fail_the_stage_writing_nothing(env):
    ws, ctx, reward_file, counter, batch = env
    flaky = RewardSpec(fn=f"{reward_file}:flaky", weight=0.0)
    with pytest.raises(score.ScoreError, match=r"'flaky' failed on 4/8 .*judge unreachable"):
        score.run(_config(reward_file, [flaky]), ctx, [batch])
    assert ws.query("SELECT count(*) AS n FROM rewards").to_pylist() == [{"n": 0}]
    assert [r["status"] for r in ws.catalog.stage_runs()][-1] == "failed"

    score.run(_config(reward_file, [flaky], max_error_fraction=0.5), ctx, [batch])
    rows = ws.query("SELECT r.sample_idx, w.value, w.error FROM rewards w JOIN rollouts r USING (rollout_id) "
                    "WHERE reward_name = 'flaky' ORDER BY r.group_id, r.sample_idx").to_pylist()
    assert [r["value"] for r in rows[:4]] == [None, None, 1.0, 1.0]
    assert "RuntimeError: judge unreachable" in rows[0]["error"] and "range" in rows[1]["error"]
    totals = ws.query("SELECT count(*) FILTER (value IS NULL) AS nulls FROM rewards WHERE reward_name = 'total'").to_pylist()
    assert totals == [{"nulls": 4}]


def test_two_ray_workers_score_like_one(env):
    ws, ctx, reward_file, counter, batch = env
    reward_file.write_text(CUSTOM + textwrap.dedent('''
        @reward(low=0.0, high=1.0)
        def where(rollout):
            return float(rollout.sample_idx % 2), {"pid": os.getpid()}
    '''))
    config = score.ScoreConfig(rewards=[RewardSpec(fn="rewards.builtin.exact_match"), RewardSpec(fn=f"{reward_file}:where")])
    one = score.run(config, ctx, [batch])
    query = "SELECT rollout_id, reward_name, value FROM rewards ORDER BY ALL"
    rows_one = ws.query(query).to_pylist()
    two = score.run(config.model_copy(update={"workers": 2}), StageContext(ws, run_name="t", force=True), [batch])
    assert two.id == one.id  # workers is not part of the identity
    assert ws.query(query).to_pylist() == rows_one
    pids = {r["pid"] for r in ws.query("SELECT json_extract(details, '$.pid')::INT AS pid FROM rewards "
                                       "WHERE reward_name = 'where'").to_pylist()}
    assert len(pids) == 1 and os.getpid() not in pids  # the forced rescoring ran in a Ray worker


def test_a_large_batch_is_split_over_ray_workers_and_written_whole(env, monkeypatch):
    ws, ctx, reward_file, counter, batch = env
    reward_file.write_text(CUSTOM + textwrap.dedent('''
        @reward(low=0.0, high=1.0)
        def parity(rollout):
            return float(rollout.sample_idx % 2), {"idx": rollout.sample_idx}
    '''))  # Ray workers may predate this test's environment: no reward here reads it
    config = score.ScoreConfig(rewards=[RewardSpec(fn="rewards.builtin.exact_match"), RewardSpec(fn=f"{reward_file}:parity")])
    score.run(config, ctx, [batch])
    query = "SELECT rollout_id, reward_name, reward_version, value, details, error FROM rewards ORDER BY ALL"
    rows_one = ws.query(query).to_pylist()
    monkeypatch.setattr(score, "MIN_SLICE_ROWS", 3)  # the 8-rollout batch counts as large: 2 slices of 4
    assert score._slices(8, 2) == [(0, 4), (4, 8)] and score._slices(8, 1) == [None]
    score.run(config.model_copy(update={"workers": 2}), StageContext(ws, run_name="t", force=True), [batch])
    assert ws.query(query).to_pylist() == rows_one  # same rows, each reward artifact still one whole file
    parts = ws.catalog.get_artifact(score.run(config, ctx, [batch]).id)["meta"]["parts"][batch]
    assert [len(ws.catalog.artifact_files(p)) for p in parts.values()] == [1, 1, 1]


def test_score_workers_that_cannot_be_placed_fail_within_the_bound(env):
    """Ray workers that never get a CPU (here: an actor holds all of them) end in an error naming the
    numbers after `ray.placement_timeout_s`, not in a hang; nothing is written."""
    import ray

    from stages.cluster import RayConfig, connect

    ws, _, reward_file, _, batch = env
    reward_file.write_text(CUSTOM)
    config = score.ScoreConfig(rewards=[RewardSpec(fn="rewards.builtin.exact_match"), RewardSpec(fn=f"{reward_file}:long_answer")],
                               workers=2)
    connect(RayConfig(), num_cpus=2)
    cpus = ray.cluster_resources()["CPU"]
    hog = ray.remote(num_cpus=cpus)(_Hog).remote()
    ray.get(hog.ready.remote())
    try:
        ctx = StageContext(ws, run_name="t", ray=RayConfig(placement_timeout_s=2))
        with pytest.raises(RuntimeError, match=rf"a score task \(score.workers: 2\) needs 1 CPU; the Ray cluster has "
                                               rf"{cpus:g}, 0 free, and none came free within 2 s"):
            score.run(config, ctx, [batch])
    finally:
        ray.kill(hog)
    assert ws.query("SELECT count(*) AS n FROM rewards").to_pylist() == [{"n": 0}]


class _Hog:
    def ready(self) -> bool:
        return True
