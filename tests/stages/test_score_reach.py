"""Rescoring after an edit to a helper the reward calls (in another file) computes a new reward version
with the edited code, instead of finding the "unchanged" reward in the catalog and reusing stale values."""

from __future__ import annotations

import textwrap

import pytest

from rewards.base import RewardSpec
from stages import score
from stages.common import StageContext
from tests.storage.conftest import add_batch, ws  # noqa: F401 - the ws fixture

REWARD = textwrap.dedent(
    '''\
    from rewards.base import reward
    from answers import is_correct

    @reward(low=0.0, high=1.0)
    def correct(rollout):
        return float(is_correct(rollout.messages[-1].content or ""))
    '''
)
HELPER = 'def is_correct(answer):\n    return answer == "1987"\n'


@pytest.mark.slow  # ~40 s on a loaded machine, most of it creating the workspace's MLflow database
def test_a_helper_edit_rescores_with_a_new_version(ws, tmp_path) -> None:  # noqa: F811 - the fixture
    (tmp_path / "answers.py").write_text(HELPER)
    (tmp_path / "my_rewards.py").write_text(REWARD)
    add_batch(ws, "ro-h", groups=2, size=4, reward_version=None)  # odd samples answer "1987", even "no idea"
    ctx = StageContext(ws, run_name="t")
    config = score.ScoreConfig(rewards=[RewardSpec(fn=f"{tmp_path / 'my_rewards.py'}:correct")], total=None)

    first = score.run(config, ctx, ["ro-h"])
    v1 = score.versions(config)["correct"]
    (tmp_path / "answers.py").write_text(HELPER.replace('answer == "1987"', 'answer != "1987"'))  # the reward file is untouched
    second = score.run(config, ctx, ["ro-h"])
    v2 = score.versions(config)["correct"]

    assert v2 != v1 and second.id != first.id and not second.cached
    rows = ws.query("SELECT rollout_id, reward_version, value FROM rewards").to_pylist()
    by_version: dict[str, dict[str, float]] = {}
    for r in rows:
        by_version.setdefault(r["reward_version"], {})[r["rollout_id"]] = r["value"]
    assert set(by_version) == {v1, v2} and len(by_version[v1]) == len(by_version[v2]) == 8
    # Every value was recomputed with the edited helper (each one flipped), none reused.
    assert all(by_version[v2][rid] == 1.0 - value for rid, value in by_version[v1].items())
    assert sum(by_version[v1].values()) == 4.0
