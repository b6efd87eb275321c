"""Scenarios from served traffic (tasks/traffic.py): picked by a window and a SQL filter, deduplicated by content,
split by session so nothing held out is trained on, and a data version that is the set itself."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from storage.traffic import TrafficLog, TrafficSettings
from storage.workspace import Workspace
from tasks.base import TaskParamsError, load_task
from tests.factories import SERVED_T0, served_call

AGENT = str(Path(__file__).resolve().parents[2] / "examples" / "doc_search_openai" / "agent.py") + ":rollout"


def traffic(ws: Workspace, rows: list[dict]) -> None:
    log = TrafficLog(ws, TrafficSettings(flush_calls=10_000, flush_seconds=3600))
    for r in rows:
        log.add(r)
    log.close()


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    """Twenty sessions of three calls each (call k of session s asks "Question s.k"), alice's sessions the even
    ones; sessions 3 and 14 also ask the same question, written differently."""
    ws = Workspace.open(tmp_path / "ws")
    rows = [served_call(10 * s + k, f"Question {s}.{k}", session=f"s{s}", episode=f"e{s}-{k}",
                        user="alice" if s % 2 == 0 else "bob") for s in range(20) for k in range(3)]
    rows.append(served_call(500, "What is the capital of France?", session="s3", at=30))
    rows.append(served_call(501, "  what is the CAPITAL of france?", session="s14", at=140))
    traffic(ws, rows)
    return ws


def split_of(task) -> dict[str, str]:
    return {p.prompt_id: split for split in ("train", "test") for p in task.prompts(split)}


def test_scenarios_are_deduplicated_and_split_by_session(ws: Workspace) -> None:
    task = load_task("traffic", {"workspace": str(ws.root), "test_fraction": 0.3})
    sides = split_of(task)
    assert len(sides) == 61  # 60 distinct questions and one asked twice
    rows = ws.query("SELECT session_id, scenario_id, messages[2].content AS q FROM traffic").to_pylist()
    by_session = defaultdict(set)
    for r in rows:
        by_session[r["session_id"]].add(sides[r["scenario_id"]])
    assert {s for s in by_session if s not in ("s3", "s14")} and all(
        len(v) == 1 for s, v in by_session.items() if s not in ("s3", "s14"))  # a conversation on one side
    assert 3 <= sum(v == {"test"} for v in by_session.values()) <= 12  # about 0.3 of 20 sessions held out
    shared = {r["scenario_id"] for r in rows if "capital" in r["q"].lower()}
    assert len(shared) == 1  # case and spacing do not make another scenario
    (key,) = shared
    own = {r["session_id"]: sides[r["scenario_id"]] for r in rows if r["q"].endswith(".0")}  # each session's side
    assert sides[key] == ("test" if "test" in (own["s3"], own["s14"]) else "train")  # held out if either asker was
    prompt = next(p for p in task.prompts(sides[key]) if p.prompt_id == key)
    assert prompt.messages[1]["content"] == "What is the capital of France?"  # the earliest asking stands for both
    assert prompt.metadata["source_call"] == "chatcmpl-500" and "alice" not in str(prompt.metadata)
    assert prompt.messages[0] == {"role": "system", "content": "Be brief."} and task.max_turns == 1


def test_a_window_and_a_filter_pick_the_calls_and_the_set_is_the_data_version(ws: Workspace) -> None:
    def task(**params):
        return load_task("traffic", {"workspace": str(ws.root), "test_fraction": 0.0, **params})

    day = task(since=(SERVED_T0.replace(second=20)).isoformat(), until=SERVED_T0.replace(second=40).isoformat())
    assert sorted(p.question for p in day.prompts("train")) == sorted(
        [f"Question {s}.{k}" for s in (2, 3) for k in range(3)] + ["What is the capital of France?"])
    alice = task(where="user_id = 'alice'")
    assert {p.question.split(".")[0] for p in alice.prompts("train")} == {f"Question {s}" for s in range(0, 20, 2)}
    assert task().data_version == task().data_version and day.data_version != task().data_version
    later = task(until=SERVED_T0.replace(second=40).isoformat())
    traffic(ws, [served_call(900, "A new question tonight", at=45)])  # after the window: the same data
    assert task(until=SERVED_T0.replace(second=40).isoformat()).data_version == later.data_version
    assert len(task(max_scenarios=5).prompts("train")) == 5
    with pytest.raises(TaskParamsError, match="task.params.where: the traffic query failed"):
        task(where="no_such_column = 1")
    with pytest.raises(TaskParamsError, match="task.params.since: an ISO 8601 time"):
        task(since="yesterday")


def test_with_an_agent_a_scenario_is_an_episode_s_first_question(ws: Workspace) -> None:
    task = load_task("traffic", {"workspace": str(ws.root), "test_fraction": 0.0, "entry": AGENT})
    prompts = task.prompts("train")
    assert task.agent is not None and task.agent.form == "client"
    assert len(prompts) == 61 and all(p.messages is None and p.prompt_id.startswith("in-") for p in prompts)
    assert {p.question for p in prompts} >= {"Question 0.0", "What is the capital of France?"}


@pytest.mark.slow
def test_an_agent_runs_again_on_each_scenario_through_the_policy_service(ws: Workspace, tiny_model_dir) -> None:
    from stages import rollout
    from stages.common import StageContext, base_policy
    from storage.schema import Rollout, from_table

    spec = rollout.TaskSpec(name="traffic", params={"workspace": str(ws.root), "test_fraction": 0.0,
                                                    "entry": "tests.stages.service.agents_for_tests:flaky",
                                                    "where": "session_id IN ('s0', 's1')"})
    config = rollout.RolloutConfig(prompts_per_step=6, group_size=2, max_new_tokens=4, max_total_tokens=256)
    ref = rollout.run(config, StageContext(ws), base_policy(ws, str(tiny_model_dir)), spec)
    rows = from_table(ws.read_artifact(ref.id), Rollout)
    asked = {r["input_id"]: r["q"] for r in ws.query(
        "SELECT input_id, messages[2].content AS q FROM traffic WHERE session_id IN ('s0', 's1')").to_pylist()}
    assert len(rows) == 12 and {r.prompt_id for r in rows} == set(asked)  # every scenario, a group of two each
    for r in rows:  # the agent got the served question, and its one call was recorded token for token
        assert r.task == "traffic" and r.messages[0].content == asked[r.prompt_id] and sum(r.loss_mask) > 0
