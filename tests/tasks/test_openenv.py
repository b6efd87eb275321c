"""OpenEnv environments through the rollout stage: a real openenv-core app under uvicorn on 127.0.0.1
(started by rlops), played by the tiny model through the policy service, every step stored and
queryable, and the faults of issue 32 with real processes (a server killed mid-group, a slow step, an
observation that does not validate, an unreachable url, too few sessions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rewards.builtin import env as env_reward
from stages import rollout
from stages.common import StageContext, base_policy
from storage.schema import Rollout, from_table
from storage.workspace import Workspace
from tasks.base import load_task

GUESS = "examples.environments.guess_env:app"
FAULTY = "tests.tasks.openenv_env_for_tests:app"
LOOKUP = "examples.environments.lookup_env:app"


def _run(tmp_path: Path, model_dir: Path, params: dict, prompts: int = 2, group_size: int = 2,
         groups_per_shard: int = 4, ws: Workspace | None = None) -> tuple[Workspace, list[Rollout]]:
    ws = ws or Workspace.open(tmp_path / "ws")
    policy = base_policy(ws, str(model_dir))
    task = rollout.TaskSpec(name="openenv", params=params)
    config = rollout.RolloutConfig(prompts_per_step=prompts, group_size=group_size, max_new_tokens=40,
                                   max_total_tokens=1536, groups_per_shard=groups_per_shard)
    ref = rollout.run(config, StageContext(ws), policy, task)
    return ws, sorted(from_table(ws.read_artifact(ref.id), Rollout), key=lambda r: r.rollout_id)


def test_guess_episodes_are_stored_step_by_step_and_scored(tmp_path, tiny_model_dir):
    ws, rows = _run(tmp_path, tiny_model_dir, {"app": GUESS, "max_turns": 3})
    assert len(rows) == 4 and {r.prompt_id for r in rows} == {"seed-0", "seed-1"}
    for r in rows:
        assert r.finish_reason != "error", r.metadata.get("error")
        steps = r.metadata["env_steps"]
        assert 1 <= len(steps) <= 3 and [s["turn"] for s in steps] == list(range(1, len(steps) + 1))
        # tool_choice "required": every turn is a call of the GuessAction schema (bounds included), so every
        # complete turn is an environment step; one cut off by max_new_tokens is told why and sends nothing.
        for s in steps:
            assert (s["error"] is None and s["reward"] is not None and 1 <= json.loads(s["action"])["guess"] <= 16) or \
                (s["action"] is None and s["observation"] == f"error: {s['error']}" and s["reward"] is None)
        assert r.metadata["env_end"] == ("done" if steps[-1]["done"] else "max_turns")
        assert r.segment_starts == [] and sum(r.loss_mask) > 0  # one token-exact segment
        tools = [m for m in r.messages if m.role == "tool"]
        assert [m.content for m in tools] == [s["observation"] for s in steps]
        assert r.messages[1].role == "user" and "Guess it" in r.messages[1].content
        assert r.metadata["env"]["server"]["name"] == "guess" and r.metadata["env"]["openenv_core"]
        value, details = env_reward(r)
        assert value == sum(s["reward"] for s in steps) and details["end"] == r.metadata["env_end"]
    # The same seed is the same secret: a group's episodes that guess the same first number hear the same.
    by_first = {}
    for r in rows:
        first = r.metadata["env_steps"][0]
        if first["error"] is None:
            by_first.setdefault((r.prompt_id, first["action"]), set()).add(first["observation"])
    assert all(len(v) == 1 for v in by_first.values())
    assert sum(s["error"] is None for r in rows for s in r.metadata["env_steps"]) >= 4  # most turns are real steps
    _shown_step_by_step(rows[0])
    # Every step is queryable in `rlops sql`'s sandbox: mean step reward by turn, and how episodes ended.
    from storage.sql import Sandbox

    sandbox = Sandbox(ws.settings)
    by_turn = sandbox.query(STEP_REWARD_BY_TURN).to_pylist()
    assert [row["turn"] for row in by_turn] == sorted(row["turn"] for row in by_turn) and by_turn[0]["turn"] == 1
    assert sum(row["steps"] for row in by_turn) == sum(len(r.metadata["env_steps"]) for r in rows)
    ended = {row["env_end"]: row["share"] for row in sandbox.query(ENDINGS).to_pylist()}
    assert abs(sum(ended.values()) - 1.0) < 1e-9 and set(ended) <= {"done", "max_turns"}


def test_an_environment_with_mcp_tools_offers_them_and_each_call_is_a_step(tmp_path, tiny_model_dir):
    """lookup_env is an MCPEnvironment: the model is offered its two tools (not one `act` tool), and every
    call goes through a `call_tool` step whose result is the tool message, with the step's reward and done."""
    with pytest.raises(ValueError, match=r"acts through its MCP tools \(lookup, answer\): use action: tool"):
        load_task("openenv", {"app": LOOKUP, "action": "text"})
    ws, rows = _run(tmp_path, tiny_model_dir, {"app": LOOKUP, "max_turns": 3})
    assert len(rows) == 4
    calls = []
    for r in rows:
        assert r.finish_reason != "error", r.metadata.get("error")
        assert r.messages[1].role == "user" and "Which number is stored under the key" in r.messages[1].content
        assert r.metadata["env"]["tools"] and r.segment_starts == []
        tools = [m for m in r.messages if m.role == "tool"]
        steps = r.metadata["env_steps"]
        assert [m.content for m in tools] == [s["observation"] for s in steps]
        for s in steps:
            if s["error"] is not None:  # a call cut off by max_new_tokens: told why, nothing sent
                assert s["action"] is None and s["reward"] is None
                continue
            action = json.loads(s["action"])
            calls.append(action["tool_name"])
            if action["tool_name"] == "lookup":
                assert s["observation"].isdigit() or s["observation"].startswith("no such key"), s
                assert s["reward"] == 0.0 and not s["done"]
            else:
                assert action["tool_name"] == "answer" and s["observation"] in ("correct", "wrong") and s["done"]
                assert s["reward"] == (1.0 if s["observation"] == "correct" else 0.0)
        assert r.metadata["env_end"] == ("done" if steps and steps[-1]["done"] else "max_turns")
    assert set(calls) == {"lookup", "answer"}  # both tools offered and called


def _shown_step_by_step(r: Rollout) -> None:
    """`rlops inspect` (terminal and HTML) shows each step's action, reward, done and observation."""
    from bs4 import BeautifulSoup
    from rich.console import Console

    from flows.views.inspect_render import _html_env_steps, _print_env_steps
    from flows.views.inspection import Episode

    ep = Episode(rollout=r, step=None, segments=[], scores=[])
    cells = [[td.get_text() for td in tr.select("td")] for tr in BeautifulSoup(_html_env_steps(ep), "html.parser").select("tr")[1:]]
    steps = r.metadata["env_steps"]
    assert [c[0] for c in cells] == [str(s["turn"]) for s in steps] and [c[4] for c in cells] == [s["observation"] for s in steps]
    console = Console(record=True, width=200)
    _print_env_steps(console, ep)
    text = console.export_text()
    assert f"ended by {r.metadata['env_end']}" in text and all(s["observation"][:30] in text for s in steps)


# The two queries docs/TASKS.md gives for an environment run (what `rlops sql` runs them on: the rollouts view).
STEP_REWARD_BY_TURN = """
SELECT s.turn, avg(s.reward) AS mean_reward, count(*) AS steps, avg(s.done::INT) AS done_share
FROM (SELECT unnest(from_json(json_extract(metadata, '$.env_steps'),
                              '[{"turn": "INTEGER", "reward": "DOUBLE", "done": "BOOLEAN"}]')) AS s FROM rollouts)
GROUP BY s.turn ORDER BY s.turn"""
ENDINGS = """
SELECT json_extract_string(metadata, '$.env_end') AS env_end, count(*) / sum(count(*)) OVER () AS share
FROM rollouts WHERE finish_reason != 'error' GROUP BY env_end"""


def test_text_actions_and_the_server_killed_mid_group(tmp_path, tiny_model_dir):
    """Seed 1's episodes kill the server on their second step: those become error rows naming the
    environment, the episode and the step; the shard goes on; the next shard's episodes get a new server."""
    params = {"app": FAULTY, "action": "text", "max_turns": 3, "reset": {"fault": "kill"}, "step_timeout_s": 10,
              "max_error_frac": 1.0}
    ws, rows = _run(tmp_path, tiny_model_dir, params, prompts=3, groups_per_shard=1)
    errors = [r for r in rows if r.finish_reason == "error"]
    assert {r.prompt_id for r in errors} == {"seed-1"} and len(errors) == 2, [(r.prompt_id, r.metadata["error"]) for r in errors]
    # A rerun finds the same batch (the restarted server's new port is no part of its identity): nothing regenerated.
    _, again = _run(tmp_path, tiny_model_dir, params, prompts=3, groups_per_shard=1, ws=ws)
    assert [r.rollout_id for r in again] == [r.rollout_id for r in rows] and again[0].created_at == rows[0].created_at
    for r in errors:
        assert f"episode {r.rollout_id} (seed 1), step 2" in r.metadata["error"]
        assert "environment openenv FaultyEnvironment (tests.tasks.openenv_env_for_tests:app)" in r.metadata["error"]
    ok = [r for r in rows if r.finish_reason != "error"]
    assert {r.prompt_id for r in ok} == {"seed-0", "seed-2"}  # seed-2 ran on the restarted server
    for r in ok:
        assert [s["reward"] for s in r.metadata["env_steps"]] == [0.5, 0.5, 0.5] and r.metadata["env_end"] == "done"
        assert [m.role for m in r.messages][1:] == ["user"] + ["assistant", "user"] * 3  # text mode: observations as user turns


@pytest.mark.parametrize("fault, message", [
    ("slow", "step 2: step: no answer within step_timeout_s=4"),
    ("bad", "step 2: step: ValueError: the observation does not validate against the server's schema"),
])
def test_slow_steps_and_invalid_observations_are_error_rows(tmp_path, tiny_model_dir, fault, message):
    # 4 s: the other episodes' steps must answer within it on a loaded CI machine; the slow step sleeps 8 s.
    params = {"app": FAULTY, "action": "text", "max_turns": 3, "reset": {"fault": fault}, "step_timeout_s": 4,
              "max_error_frac": 1.0}
    _, rows = _run(tmp_path, tiny_model_dir, params)
    errors = [r for r in rows if r.finish_reason == "error"]
    assert {r.prompt_id for r in errors} == {"seed-1"} and all(message in r.metadata["error"] for r in errors)
    assert all(r.metadata["env_end"] == "done" for r in rows if r.finish_reason != "error")


def test_bad_environments_are_refused_before_compute(tmp_path, tiny_model_dir):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ValueError, match=f"cannot reach the OpenEnv server at {dead}"):
        load_task("openenv", {"url": dead})
    with pytest.raises(ValueError, match="overlap"):
        load_task("openenv", {"app": GUESS, "train_seeds": [0, 100], "eval_seeds": [50, 60]})
    with pytest.raises(ValueError, match="exactly one string field"):
        load_task("openenv", {"app": GUESS, "action": "text"})
    with pytest.raises(ValueError, match="did not start"):
        load_task("openenv", {"app": "tests.tasks.no_such_module:app"})
    # A server holding 2 sessions cannot play a group of 4 at once: named before the model is loaded.
    ws = Workspace.open(tmp_path / "ws")
    with pytest.raises(ValueError, match=r"holds 2 concurrent sessions, but a shard runs 4 episodes at once"):
        _run(tmp_path, tiny_model_dir, {"app": "tests.tasks.openenv_env_for_tests:small", "action": "text"},
             prompts=1, group_size=4, ws=ws)
    assert ws.query("SELECT count(*) AS n FROM rollouts").to_pylist() == [{"n": 0}]


def test_lamp_env_rewards_each_right_press_and_ends_on_a_wrong_one():
    from examples.environments.lamp_env import REWARD_PER_LAMP, ButtonAction, LampEnvironment

    env = LampEnvironment()
    first = env.reset(seed=1_000_000)
    assert f"Lamp 1 lights up {env.lamps[0].upper()}." in first.message and not first.done
    right = env.step(ButtonAction(button=env.lamps[0]))
    assert (right.reward, right.done) == (REWARD_PER_LAMP, False) and env.lamps[1].upper() in right.message
    wrong = env.step(ButtonAction(button=next(c for c in ("red", "green") if c != env.lamps[1])))
    assert (wrong.reward, wrong.done) == (0.0, True) and wrong.message.endswith("Game over.")
    assert LampEnvironment().reset(seed=1_000_000).message == first.message  # a seed is a reproducible episode


def test_a_served_apps_log_folder_is_removed_at_exit():
    """The app server rlops starts logs into a temporary folder; when the process that started it exits, the server
    stops and the folder goes with it (before, every rollout process left one behind in the temp dir)."""
    import subprocess
    import sys

    code = f"from tasks.openenv import served; print(served({GUESS!r}).log.parent, flush=True)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    folder = Path(out.stdout.strip().splitlines()[-1])
    assert folder.name.startswith("rlops-openenv-") and not folder.exists()
