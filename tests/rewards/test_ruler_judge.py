"""The RULER judge against a real chat-completions server on 127.0.0.1 (no HTTP mocks)."""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import pytest

from rewards.base import RewardSpec, compute
from rewards.judge_client import OpenAIClient
from rewards.ruler import DEFAULT_RUBRIC, Usage, common_prefix_len, orders, rank, verdict_format
from storage.schema import Message

FAKE_KEY = "sk-test-0123456789abcdef-SECRET"


def shown(body: dict[str, Any]) -> dict[str, str]:
    """Trajectory id -> rendered text, as the judge sees them in a request."""
    return dict(re.findall(r'<trajectory id="(\d+)">\n(.*?)\n</trajectory>', body["messages"][1]["content"], re.S))


def scores_json(scores: dict[str, float]) -> str:
    return json.dumps({"scores": [{"id": i, "score": s, "explanation": f"looked at {i}"} for i, s in scores.items()]})


def content_judge(server):
    """1.0 for a trajectory whose text contains 82, else 0.0: a judge without position bias."""
    return lambda body, headers: server.ok(scores_json({i: float("82" in t) for i, t in shown(body).items()}))


def first_position_judge(server):
    """1.0 for whatever is shown first, 0.0 for the rest: pure position bias."""
    return lambda body, headers: server.ok(scores_json({i: float(i == "1") for i in shown(body)}))


def group(make_rollout, answers: list[str], group_id: str = "g0") -> list:
    return [make_rollout([Message("assistant", a)], {"answer": 82}, group_id=group_id, sample_idx=i) for i, a in enumerate(answers)]


def judge_spec(server, **params: Any) -> RewardSpec:
    base = {"base_url": server.url, "model": "judge-model", "timeout": 5.0, "max_retries": 2, "backoff": 0.01}
    return RewardSpec(name="ruler", fn="rewards.ruler.ruler_reward", params={**base, **params})


def test_valid_scores(judge_server, make_rollout) -> None:
    judge_server.respond = content_judge(judge_server)
    outs = compute(judge_spec(judge_server), group(make_rollout, ["82", "81", "I think 82"]))
    assert [o.value for o in outs] == [1.0, 0.0, 1.0] and all(o.error is None for o in outs)
    assert outs[0].details["explanation"].startswith("looked at")
    assert outs[0].details["group_usage"] == {"requests": 1, "prompt_tokens": 10, "completion_tokens": 5, "cache_hits": 0}

    [request] = judge_server.requests  # one request for the whole group
    body = request["body"]
    assert request["path"] == "/v1/chat/completions"
    assert body["model"] == "judge-model" and body["response_format"] == verdict_format(3)  # bound to the ids
    assert outs[0].details["verdict_format"] == "json_schema"
    assert DEFAULT_RUBRIC in body["messages"][0]["content"]
    user = body["messages"][1]["content"]
    assert user.count("What is 40 + 42?") == 1  # the shared prefix is sent once, as context
    assert user.startswith("<context>") and sorted(shown(body)) == ["1", "2", "3"]


def test_custom_rubric_and_one_request_per_group(judge_server, make_rollout) -> None:
    judge_server.respond = content_judge(judge_server)
    rollouts = group(make_rollout, ["82", "1"], "a") + group(make_rollout, ["5", "82"], "b")
    outs = compute(judge_spec(judge_server, rubric="Only the number 82 is right."), rollouts, workers=2)
    assert [o.value for o in outs] == [1.0, 0.0, 0.0, 1.0]
    assert len(judge_server.requests) == 2
    assert all("Only the number 82 is right." in r["body"]["messages"][0]["content"] for r in judge_server.requests)


@pytest.mark.parametrize(
    "bad",
    [
        "this is not json",
        scores_json({"1": 1.0}),  # wrong number of scores
        scores_json({"1": 1.0, "7": 0.0}),  # unknown id
        scores_json({"1": 1.0, "2": 1.5}),  # out of range
        json.dumps({"verdict": "good"}),  # no scores list
    ],
)
def test_invalid_output_is_retried_once_then_errors(judge_server, make_rollout, bad) -> None:
    judge_server.script(judge_server.ok(bad))
    outs = compute(judge_spec(judge_server), group(make_rollout, ["82", "81"]))
    assert [o.value for o in outs] == [None, None]
    assert outs[0].error.startswith("JudgeError: judge output invalid after one retry")
    assert len(judge_server.requests) == 2
    retry = judge_server.requests[1]["body"]["messages"]
    assert retry[-2] == {"role": "assistant", "content": bad}
    assert retry[-1]["role"] == "user" and "could not be used" in retry[-1]["content"]


TWO = [{"id": "1", "score": 0.25, "explanation": "a"}, {"id": "2", "score": 1, "explanation": "b"}]


@pytest.mark.parametrize(
    "reply, expected",
    [
        (json.dumps({"scores": TWO}), [(0.25, "a"), (1.0, "b")]),
        ("Here are the scores:\n" + json.dumps({"scores": TWO}) + "\nHope this helps.", [(0.25, "a"), (1.0, "b")]),
        (json.dumps({"scores": TWO}) + "\n" + json.dumps({"note": 1}), [(0.25, "a"), (1.0, "b")]),  # extra data
        ("<script>\nconst json = " + json.dumps(TWO) + ";\n</script>", [(0.25, "a"), (1.0, "b")]),  # a bare list
        # found but invalid, or nothing usable: the reason says which
        ("Scores: " + json.dumps({"scores": TWO[:1]}), "expected 2 scores, got 1"),
        ('[{"id": "1", "score": 0.25}, {"id": "2", "sc', "not valid JSON, and no scores object inside it"),
        ('I rate them {"id": "1"} and {"id": "2"} equally.', "not valid JSON, and no scores object inside it"),
        (json.dumps({"id": "1", "score": 1}), 'no "scores" list in the reply'),
    ],
)
def test_the_scores_object_is_found_inside_a_reply_and_validated(reply: str, expected) -> None:
    from rewards.ruler import parse_scores

    if isinstance(expected, str):
        with pytest.raises(ValueError, match=re.escape(expected)):
            parse_scores(reply, 2)
    else:
        assert parse_scores(reply, 2) == expected


def test_invalid_then_valid_succeeds(judge_server, make_rollout) -> None:
    judge_server.script(judge_server.ok("{oops"), judge_server.ok("```json\n" + scores_json({"1": 0.25, "2": 0.75}) + "\n```"))
    outs = compute(judge_spec(judge_server), group(make_rollout, ["82", "81"]))
    assert [o.value for o in outs] == [0.25, 0.75]
    assert outs[0].details["group_usage"]["requests"] == 2


def test_http_500_is_retried(judge_server, make_rollout) -> None:
    judge_server.script((500, {"error": "overloaded"}, 0.0), (429, {"error": "slow down"}, 0.0), judge_server.ok(scores_json({"1": 1.0, "2": 0.0})))
    outs = compute(judge_spec(judge_server), group(make_rollout, ["82", "81"]))
    assert [o.value for o in outs] == [1.0, 0.0]
    assert len(judge_server.requests) == 3


def test_persistent_500_gives_error_rows(judge_server, make_rollout) -> None:
    judge_server.script((503, {"error": "down"}, 0.0))
    outs = compute(judge_spec(judge_server, max_retries=1), group(make_rollout, ["82", "81"]))
    assert all(o.value is None and "after 2 attempts: HTTP 503" in o.error for o in outs)


def test_slow_judge_times_out_without_hanging(judge_server, make_rollout) -> None:
    judge_server.script((200, {"choices": []}, 3.0))
    start = time.monotonic()
    outs = compute(judge_spec(judge_server, timeout=0.3, max_retries=1), group(make_rollout, ["82", "81"]))
    assert time.monotonic() - start < 2.5  # two attempts of 0.3 s, not the 3 s the server takes
    assert all(o.value is None and "Timeout" in o.error for o in outs)


@pytest.mark.parametrize("concurrency", [1, 3])
def test_concurrency_caps_requests_in_flight(judge_server, make_rollout, concurrency) -> None:
    judge = content_judge(judge_server)
    judge_server.respond = lambda body, headers: (*judge(body, headers)[:2], 0.2)
    rollouts = [r for g in range(6) for r in group(make_rollout, ["82", "81"], f"g{g}")]
    outs = compute(judge_spec(judge_server, concurrency=concurrency), rollouts, workers=6)
    assert [o.value for o in outs] == [1.0, 0.0] * 6
    assert judge_server.max_in_flight == concurrency  # capped, and with 6 workers the cap is reached


def test_json_mode_falls_back_when_unsupported(judge_server, make_rollout) -> None:
    def respond(body, headers):
        if "response_format" in body:
            return 400, {"error": {"message": "response_format is not supported by this model"}}, 0.0
        return judge_server.ok(scores_json({"1": 1.0, "2": 0.0}))

    judge_server.respond = respond
    outs = compute(judge_spec(judge_server), group(make_rollout, ["82", "81"]))
    # refused: the verdict schema, then JSON mode; the third request is answered and its reply validated
    assert [o.value for o in outs] == [1.0, 0.0] and len(judge_server.requests) == 3
    assert judge_server.requests[0]["body"]["response_format"]["type"] == "json_schema"
    assert judge_server.requests[1]["body"]["response_format"] == {"type": "json_object"}
    assert outs[0].details["verdict_format"] == "validated"


def test_a_schema_the_server_cannot_compile_falls_back_to_validated_replies(judge_server, make_rollout) -> None:
    """llama.cpp's server answers a JSON schema it cannot turn into a grammar with a 400 that names the schema, not the
    `response_format` field: the judge asks without schemas from then on, as for a server that refuses the field."""
    def respond(body, headers):
        if body.get("response_format", {}).get("type") == "json_schema":
            return 400, {"error": {"code": 400, "type": "invalid_request_error", "message":
                                   "Unable to generate parser for this template. Automatic parser generation failed: "
                                   "JSON schema error at #/properties/scores/items: schema must be an object"}}, 0.0
        return judge_server.ok(scores_json({"1": 1.0, "2": 0.0}))

    judge_server.respond = respond
    outs = compute(judge_spec(judge_server), group(make_rollout, ["82", "81"]))
    assert [o.value for o in outs] == [1.0, 0.0] and len(judge_server.requests) == 2
    assert judge_server.requests[1]["body"]["response_format"] == {"type": "json_object"}
    assert outs[0].details["verdict_format"] == "validated"


@pytest.mark.parametrize("n, k", [(2, 2), (3, 3), (4, 4), (4, 8)])
def test_permutations_cancel_position_bias(judge_server, make_rollout, n, k) -> None:
    judge_server.respond = first_position_judge(judge_server)
    identical = group(make_rollout, ["82"] * n)
    biased = compute(judge_spec(judge_server), identical)
    assert sorted(o.value for o in biased) == [0.0] * (n - 1) + [1.0]  # one order: the bias decides

    judge_server.requests.clear()
    outs = compute(judge_spec(judge_server, permutations=k), identical)
    assert all(o.value == pytest.approx(1 / n) for o in outs)
    assert len(judge_server.requests) == k
    assert len(outs[0].details["permutation_scores"]) == k


def test_permutations_map_scores_back_to_their_trajectory(judge_server, make_rollout) -> None:
    judge_server.respond = content_judge(judge_server)
    outs = compute(judge_spec(judge_server, permutations=3), group(make_rollout, ["82", "1", "2", "82"]))
    assert [o.value for o in outs] == [1.0, 0.0, 0.0, 1.0]


def test_orders_are_deterministic_and_balanced() -> None:
    assert orders(5, 3, "s") == orders(5, 3, "s")
    firsts = [o[0] for o in orders(5, 5, "s")]
    assert sorted(firsts) == [0, 1, 2, 3, 4]  # k = n: everyone is shown first once
    assert all(sorted(o) == list(range(5)) for o in orders(5, 3, "s"))


def test_second_scoring_hits_the_cache(judge_server, make_rollout, tmp_path: Path) -> None:
    judge_server.respond = content_judge(judge_server)
    spec = judge_spec(judge_server, permutations=2, cache_dir=str(tmp_path / "cache" / "judge"))
    rollouts = group(make_rollout, ["82", "81", "80"])
    first = compute(spec, rollouts)
    assert len(judge_server.requests) == 2
    second = compute(spec, rollouts)
    assert len(judge_server.requests) == 2  # zero HTTP calls the second time
    assert [o.value for o in second] == [o.value for o in first] == [1.0, 0.0, 0.0]
    assert second[0].details["group_usage"]["cache_hits"] == 2 and second[0].details["group_usage"]["requests"] == 0
    files = list((tmp_path / "cache" / "judge").rglob("*"))
    assert len([f for f in files if f.suffix == ".json"]) == 2 and not [f for f in files if f.name.startswith(".tmp")]

    # A different rubric is a different question: it goes to the judge.
    compute(judge_spec(judge_server, permutations=2, rubric="other", cache_dir=str(tmp_path / "cache" / "judge")), rollouts)
    assert len(judge_server.requests) == 4


def test_api_key_is_sent_but_never_recorded(judge_server, make_rollout, tmp_path, monkeypatch, caplog, capsys) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("RLOPS_TEST_JUDGE_KEY", FAKE_KEY)
    cache = tmp_path / "cache"
    judge_server.respond = content_judge(judge_server)
    outs = compute(judge_spec(judge_server, api_key_env="RLOPS_TEST_JUDGE_KEY", cache_dir=str(cache)), group(make_rollout, ["82", "81"]))
    assert [o.value for o in outs] == [1.0, 0.0]
    assert judge_server.requests[0]["headers"]["authorization"] == f"Bearer {FAKE_KEY}"

    # A server that echoes the key back in its errors (some hosted APIs do on 401) and in a retried 500.
    def echo(body, headers):
        status = 500 if len(judge_server.requests) == 2 else 401  # first a retried 500, then a final 401
        return status, {"error": f"bad key {headers['authorization']}"}, 0.0

    judge_server.respond = echo
    spec = judge_spec(judge_server, api_key_env="RLOPS_TEST_JUDGE_KEY", max_retries=1, rubric="new", cache_dir=str(cache))
    failed = compute(spec, group(make_rollout, ["82", "81"], "g1"))
    assert all(o.value is None and "bad key Bearer ***" in o.error for o in failed)

    recorded = [json.dumps([o.__dict__ for o in outs + failed])]
    recorded += [f.read_text() for f in cache.rglob("*") if f.is_file()]
    recorded += [caplog.text, *capsys.readouterr()]
    assert "retry 1/1" in caplog.text and "Bearer ***" in caplog.text  # the retry was logged, scrubbed
    assert all(FAKE_KEY not in text and "0123456789abcdef" not in text for text in recorded)


def test_missing_api_key_env_is_an_error_row(judge_server, make_rollout, monkeypatch) -> None:
    monkeypatch.delenv("RLOPS_TEST_UNSET_KEY", raising=False)
    outs = compute(judge_spec(judge_server, api_key_env="RLOPS_TEST_UNSET_KEY"), group(make_rollout, ["82"]))
    assert outs[0].value is None and "RLOPS_TEST_UNSET_KEY" in outs[0].error
    assert judge_server.requests == []


def test_rank_directly(judge_server) -> None:
    judge_server.respond = content_judge(judge_server)
    prefix = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    trajectories = [prefix + [{"role": "assistant", "content": "82"}], prefix + [{"role": "assistant", "content": "0"}]]
    client = OpenAIClient(judge_server.url, "judge-model", backoff=0.01)
    usage = Usage()
    scores = rank(trajectories, None, client, ids=["a", "b"], usage=usage)
    assert [(s.id, s.score) for s in scores] == [("a", 1.0), ("b", 0.0)]
    assert usage.requests == 1 and usage.prompt_tokens == 10 and usage.completion_tokens == 5
    assert rank([], None, client) == []


@pytest.mark.parametrize(
    "trajectories, expected",
    [
        ([["s", "u", "a"], ["s", "u", "b"]], 2),
        ([["s", "u", "a"], ["s", "x", "a"]], 1),
        ([["s", "u", "a"], ["s", "u", "a"]], 2),  # identical: each still shows its last message
        ([["s", "u"], ["s", "u", "a", "b"]], 1),
        ([["a"], ["a"]], 0),
    ],
)
def test_common_prefix_len(trajectories, expected) -> None:
    assert common_prefix_len(trajectories) == expected
