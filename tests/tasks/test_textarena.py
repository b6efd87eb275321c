"""TextArena games through the rollout stage: GuessTheNumber-v0 (offline, no NLTK data) played by the
tiny model, each move a step, the game's own reward at the end; unknown and two-player games refused."""

from __future__ import annotations

import pytest

from flows import pipeline
from flows.run_config import from_dict
from rewards.builtin import env as env_reward
from stages import rollout
from stages.common import StageContext, base_policy
from storage.schema import Rollout, from_table
from storage.workspace import Workspace
from tasks.base import load_task
from tests.flows.conftest import tiny_config


def test_guess_the_number_episodes_are_played_move_by_move(tmp_path, tiny_model_dir):
    ws = Workspace.open(tmp_path / "ws")
    task = rollout.TaskSpec(name="textarena", params={"env_id": "GuessTheNumber-v0", "max_turns": 2})
    config = rollout.RolloutConfig(prompts_per_step=1, group_size=2, max_new_tokens=8, max_total_tokens=1536)
    ref = rollout.run(config, StageContext(ws), base_policy(ws, str(tiny_model_dir)), task)
    rows = from_table(ws.read_artifact(ref.id), Rollout)
    assert len(rows) == 2
    for r in rows:
        assert r.finish_reason != "error", r.metadata.get("error")
        assert "Guess The Number" in r.messages[1].content and r.metadata["env"]["env_id"] == "GuessTheNumber-v0"
        steps = r.metadata["env_steps"]
        # a random model's moves are invalid; TextArena may end the game on them (done, its own reward)
        assert [s["turn"] for s in steps] == list(range(1, len(steps) + 1)) and len(steps) <= 2
        assert r.metadata["env_end"] == ("done" if steps[-1]["done"] else "max_turns")
        assert all(s["reward"] is None for s in steps[:-1]) and (steps[-1]["reward"] is not None) == steps[-1]["done"]
        # each move is the assistant's text, and the game's answer to it is the next user turn
        assert [s["action"] for s in steps] == [m.content for m in r.messages if m.role == "assistant"]
        assert [s["observation"] for s in steps] == [m.content for m in r.messages[3::2]]
        assert all(s["observation"].startswith("[Player]") for s in steps)
        assert env_reward(r)[0] == (steps[-1]["reward"] or 0.0) and r.segment_starts == []


@pytest.mark.parametrize("env_id, message", [
    ("NoSuchGame-v0", "cannot make 'NoSuchGame-v0': ValueError: Environment NoSuchGame-v0 not found"),
    ("TicTacToe-v0", "TicTacToe-v0 is not a single-player game"),
])
def test_unknown_and_two_player_games_are_refused(env_id, message):
    with pytest.raises(ValueError, match=message):
        load_task("textarena", {"env_id": env_id})


def test_a_tiny_model_trains_on_guess_the_number_end_to_end(tmp_path, tiny_model_dir):
    data = {**tiny_config(tiny_model_dir, name="ta", steps=1), "sft": None,
            "task": {"name": "textarena", "params": {"env_id": "GuessTheNumber-v0", "max_turns": 2}},
            "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8, "max_total_tokens": 1536},
            "score": {"rewards": [{"name": "env", "fn": "rewards.builtin.env"}]},
            "eval": {"n_prompts": 2, "every": 1, "metric": "env"}}
    ws = Workspace.open(tmp_path / "ws")
    result = pipeline.train(from_dict(data), StageContext(ws, run_name="ta"))
    assert len(result.policies) == 1 and ws.catalog.get_checkpoint(result.final)["kind"] == "grpo"
    rows = ws.query("SELECT r.task, r.finish_reason, w.value, w.error FROM rollouts r JOIN rewards w USING (rollout_id) "
                    "WHERE w.reward_name = 'env'").to_pylist()
    assert len(rows) == 2 * 2 + 2 * 2  # one step's 2 groups of 2, and the held-out split before and after
    assert {r["task"] for r in rows} == {"textarena"}
    assert all(r["finish_reason"] != "error" and r["error"] is None for r in rows)
