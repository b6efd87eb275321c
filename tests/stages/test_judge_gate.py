"""The label-free gate's comparison (stages/judge_gate.py): hand-built answer batches in a real workspace, a real
HTTP judge on 127.0.0.1 whose first-token log-probs are scripted, the verdicts read back with SQL."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stages.common import StageContext
from stages.judge_gate import GateJudge, JudgeGateConfig, judge_version, outcome, run
from stages.promote import PromoteConfig, decide_by_judge
from storage.schema import to_table
from tests.factories import tool_episode
from tests.rewards.conftest import judge_server  # noqa: F401 - the judge_server fixture
from tests.rewards.test_judge_modes import shown, top_reply
from tests.storage.conftest import ws  # noqa: F401 - the ws fixture

RIGHT, WRONG = "1987", "1897"  # final answers to tool_episode's question (founded in 1987)


def answers(ws, batch_id: str, policy: str, finals: list[str]) -> str:  # noqa: F811
    """A complete answer batch of `policy`: one doc_search episode per prompt q0, q1, ... ending in `finals`. Each
    prompt's question is its own, so no prompt's pair is another's (the judge's cache would answer it)."""
    episodes = []
    for g, final in enumerate(finals):
        episode = tool_episode(batch_id, g, 0, answer=final)
        question = replace(episode.messages[1], content=f"{episode.messages[1].content} (q{g})")
        messages = [episode.messages[0], question, *episode.messages[2:]]
        episodes.append(replace(episode, policy_id=policy, messages=messages))
    ws.write_part("rollouts", batch_id, to_table(episodes), part="groups-00000")
    ws.catalog.complete_artifact(batch_id, "rollouts", "rollout", [], "cfg")
    return batch_id


def gate_config(url: str, **judge: object) -> JudgeGateConfig:
    return JudgeGateConfig(judge=GateJudge(**{"model": "scripted-judge", "base_url": url, "timeout": 5.0, **judge}),
                           resamples=1000)


def judge(prefer: float, first_bias: float = 0.0):
    """A judge that prefers the right answer by `prefer` and whatever it is shown first by `first_bias`:
    P("1") = 0.5 + prefer * (right(1) - right(2)) + first_bias."""
    def respond(body, headers):
        a, b = shown(body)
        p1 = 0.5 + prefer * ((a == RIGHT) - (b == RIGHT)) + first_bias
        return top_reply({"1": p1, "2": 1.0 - p1})
    return respond


def test_each_prompt_gets_a_row_with_both_orders_and_their_mean(ws, judge_server):  # noqa: F811
    champion = answers(ws, "ro-champion", "ck-champion", [WRONG, WRONG, RIGHT])
    challenger = answers(ws, "ro-challenger", "ck-challenger", [RIGHT, RIGHT, WRONG])
    judge_server.respond = judge(prefer=0.25, first_bias=0.15)  # a position bias the two orders cancel
    config = gate_config(judge_server.url)
    ref = run(config, StageContext(ws), champion, challenger)

    assert len(judge_server.requests) == 6  # both orders of each prompt's pair
    orders = sorted(tuple(shown(r["body"])) for r in judge_server.requests)
    assert orders == sorted([(RIGHT, WRONG), (WRONG, RIGHT)] * 3)
    rows = ws.query("SELECT prompt_id, champion, challenger, p_challenger_first, p_challenger_second, win, error, "
                    "judge_model, judge_version FROM verdicts WHERE comparison_id = $id ORDER BY prompt_id",
                    {"id": ref.id}).to_pylist()
    # The right challenger: 0.9 shown first, 1 - 0.4 shown second; the wrong one: 0.4 first, 1 - 0.9 second.
    expected = [("q0", 0.9, 0.6, 0.75), ("q1", 0.9, 0.6, 0.75), ("q2", 0.4, 0.1, 0.25)]
    assert [(r["prompt_id"], r["p_challenger_first"], r["p_challenger_second"], r["win"]) for r in rows] == [
        (p, pytest.approx(f), pytest.approx(s), pytest.approx(w)) for p, f, s, w in expected]
    version = judge_version(config.judge)
    assert {(r["champion"], r["challenger"], r["error"], r["judge_model"], r["judge_version"]) for r in rows} == {
        ("ck-champion", "ck-challenger", None, "scripted-judge", version)}
    measured = outcome(ws, ref.id)
    assert measured.win_rate == pytest.approx(1.75 / 3) and (measured.prompts, measured.errors) == (3, 0)
    assert measured.low <= measured.win_rate <= measured.high and measured.judge_version == version


@pytest.mark.parametrize("respond, win, promoted, why", [
    (lambda body, headers: top_reply({"1": 1.0}), 0.5, False, "does not clear min_win_rate 0.5"),  # position bias only
    (judge(prefer=0.4), 0.9, True, "clears min_win_rate 0.5"),
    (judge(prefer=-0.4), 0.1, False, "prefers the champion beyond the noise"),
])
def test_the_win_rate_decides_and_a_position_bias_is_a_tie(ws, judge_server, respond, win, promoted, why):  # noqa: F811
    champion = answers(ws, "ro-a", "ck-a", [WRONG] * 6)
    challenger = answers(ws, "ro-b", "ck-b", [RIGHT] * 6)
    judge_server.respond = respond
    ref = run(gate_config(judge_server.url), StageContext(ws), champion, challenger)
    assert ws.query("SELECT DISTINCT round(win, 6) AS w FROM verdicts").to_pylist() == [{"w": win}]
    decision, reason = decide_by_judge(outcome(ws, ref.id), PromoteConfig(judge={"model": "scripted-judge"}))
    assert decision is promoted and why in reason and f"win rate {win:.3f} on 6 prompts" in reason


def test_a_prompt_the_judge_fails_on_keeps_the_reason_and_the_rest_decide(ws, judge_server):  # noqa: F811
    champion = answers(ws, "ro-a", "ck-a", [WRONG] * 4)
    challenger = answers(ws, "ro-b", "ck-b", [RIGHT, RIGHT, RIGHT, "n/a"])

    def respond(body, headers):  # prose instead of a choice whenever it sees "n/a"
        return top_reply({"The": 0.8, "I": 0.2}) if "n/a" in shown(body) else judge(prefer=0.45)(body, headers)

    judge_server.respond = respond
    ref = run(gate_config(judge_server.url), StageContext(ws), champion, challenger)
    rows = {r["prompt_id"]: r for r in ws.query("SELECT * FROM verdicts").to_pylist()}
    assert rows["q3"]["win"] is None and rows["q3"]["p_challenger_first"] is None
    assert "none of the judge's likely first tokens ('The', 'I')" in rows["q3"]["error"]
    assert [rows[p]["win"] for p in ("q0", "q1", "q2")] == pytest.approx([0.95] * 3)
    measured = outcome(ws, ref.id)
    assert (measured.prompts, measured.errors, measured.win_rate) == (3, 1, pytest.approx(0.95))
    promoted, reason = decide_by_judge(measured, PromoteConfig(judge={"model": "scripted-judge"}))
    assert promoted and "on 3 prompts, 1 without a verdict" in reason


def test_identical_answers_are_ties_without_a_request(ws, judge_server):  # noqa: F811
    champion = answers(ws, "ro-a", "ck-a", [RIGHT, RIGHT, WRONG])
    challenger = answers(ws, "ro-b", "ck-b", [RIGHT, RIGHT, RIGHT])
    judge_server.respond = judge(prefer=0.3)
    ref = run(gate_config(judge_server.url), StageContext(ws), champion, challenger)
    assert len(judge_server.requests) == 2  # the one prompt whose answers differ, in both orders
    rows = ws.query("SELECT prompt_id, p_challenger_first, win, error FROM verdicts ORDER BY prompt_id").to_pylist()
    assert [(r["prompt_id"], r["p_challenger_first"], r["win"], r["error"]) for r in rows] == [
        ("q0", None, 0.5, None), ("q1", None, 0.5, None), ("q2", pytest.approx(0.8), pytest.approx(0.8), None)]
    meta = ws.catalog.get_artifact(ref.id)["meta"]
    assert (meta["prompts"], meta["ties"], meta["errors"]) == (3, 2, 0)


def test_a_rerun_finds_the_verdicts_and_only_the_judges_version_makes_new_ones(ws, judge_server):  # noqa: F811
    champion = answers(ws, "ro-a", "ck-a", [WRONG] * 2)
    challenger = answers(ws, "ro-b", "ck-b", [RIGHT] * 2)
    judge_server.respond = judge(prefer=0.3)
    first = run(gate_config(judge_server.url), StageContext(ws), champion, challenger)
    again = run(gate_config(judge_server.url, timeout=9.0, concurrency=1, api_key_env=None), StageContext(ws),
                champion, challenger)
    assert (again.id, again.cached, len(judge_server.requests)) == (first.id, True, 4)  # not asked again
    other = run(gate_config(judge_server.url, rubric="- Shorter is better."), StageContext(ws), champion, challenger)
    assert other.id != first.id and not other.cached and len(judge_server.requests) == 8
    assert "- Shorter is better." in judge_server.requests[-1]["body"]["messages"][0]["content"]
    assert ws.query("SELECT count(DISTINCT judge_version) AS n FROM verdicts").to_pylist() == [{"n": 2}]


def test_judged_alone_each_answer_has_no_position(ws, judge_server):  # noqa: F811
    champion = answers(ws, "ro-a", "ck-a", [WRONG, WRONG, RIGHT, RIGHT])
    challenger = answers(ws, "ro-b", "ck-b", [RIGHT, WRONG + "0", RIGHT + ".", WRONG])

    def respond(body, headers):  # P(true) 0.9 for a right answer, 0.2 for a wrong one; each request shows one answer
        (final,) = shown(body)
        return top_reply({"true": 0.9 if final.startswith(RIGHT) else 0.2, "false": 0.1 if final.startswith(RIGHT) else 0.8})

    judge_server.respond = respond
    config = gate_config(judge_server.url, mode="yes_no")
    ref = run(config, StageContext(ws), champion, challenger)
    assert len(judge_server.requests) == 8 and all(len(shown(r["body"])) == 1 for r in judge_server.requests)
    rows = ws.query("SELECT prompt_id, p_champion, p_challenger, win, p_challenger_first FROM verdicts "
                    "ORDER BY prompt_id").to_pylist()
    assert [(r["prompt_id"], r["p_champion"], r["p_challenger"], r["win"]) for r in rows] == [
        ("q0", pytest.approx(0.2), pytest.approx(0.9), pytest.approx(0.85)),  # 0.5 + (0.9 - 0.2) / 2
        ("q1", pytest.approx(0.2), pytest.approx(0.2), pytest.approx(0.5)),  # both wrong: no preference
        ("q2", pytest.approx(0.9), pytest.approx(0.9), pytest.approx(0.5)),
        ("q3", pytest.approx(0.9), pytest.approx(0.2), pytest.approx(0.15))]
    assert all(r["p_challenger_first"] is None for r in rows)
    assert judge_version(config.judge) != judge_version(gate_config(judge_server.url).judge)  # the mode is versioned
    assert outcome(ws, ref.id).win_rate == pytest.approx(0.5)
