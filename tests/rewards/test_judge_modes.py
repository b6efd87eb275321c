"""The judge's pointwise and pairwise modes, read from first-token log-probs (rewards/judge_modes.py): the reading
is checked against a scripted endpoint whose distributions are known; a real tiny model behind `rlops serve` and a
local transformers judge score groups without generating a reply."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from rewards.base import RewardSpec, compute, reward_version
from rewards.judge_client import OpenAIClient, TransformersClient
from rewards.judge_modes import choice_format, judge_group, read_choice
from rewards.ruler import Usage
from storage.schema import Message


def top_reply(probs: dict[str, float], completion_tokens: int = 1) -> tuple[int, dict[str, Any], float]:
    """A chat-completions reply whose first token has these top alternatives (what `logprobs` returns)."""
    top = [{"token": t, "logprob": math.log(p), "bytes": list(t.encode())} for t, p in probs.items()]
    first = max(probs, key=probs.__getitem__)
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": first}, "finish_reason": "length",
                         "logprobs": {"content": [{"token": first, "logprob": math.log(probs[first]), "top_logprobs": top}]}}],
            "usage": {"prompt_tokens": 50, "completion_tokens": completion_tokens}}
    return 200, body, 0.0


def shown(body: dict[str, Any]) -> list[str]:
    """The final answers of the trajectories in a judge request, in the order shown."""
    text = body["messages"][1]["content"]
    return [json.loads(part.split("\n", 1)[1].rsplit("\n</trajectory>", 1)[0])[-1]["content"]
            for part in text.split('<trajectory id="')[1:]]


def group(make_rollout, answers: list[str]) -> list[Any]:
    return [make_rollout([Message("assistant", a)], {"answer": 82}, sample_idx=i) for i, a in enumerate(answers)]


def spec(url: str, mode: str, **params: Any) -> RewardSpec:
    return RewardSpec(fn="rewards.ruler.ruler_reward", params={"base_url": url, "model": "judge", "timeout": 5.0,
                                                               "max_retries": 0, "mode": mode, **params})


def test_read_choice_renormalises_over_the_choices_and_reads_prefixes_only_when_bound():
    values = {"true": 1.0, "false": 0.0}
    assert read_choice([("true", math.log(0.3)), ("The", math.log(0.5)), (" false", math.log(0.1))], values, False)[0] \
        == pytest.approx(0.75)
    bound = [("t", math.log(0.2)), ("true", math.log(0.4)), ("f", math.log(0.4))]
    assert read_choice(bound, values, True)[0] == pytest.approx(0.6)
    assert read_choice(bound, values, False)[0] == 1.0  # unbound, "t" and "f" may begin any word: "true" alone counts
    with pytest.raises(ValueError, match="none of the judge's likely first tokens"):
        read_choice(bound[::2], values, False)
    scale = {str(d): (d - 1) / 4 for d in range(1, 6)}
    assert read_choice([("5", math.log(0.5)), ("3", math.log(0.5))], scale, True)[0] == pytest.approx(0.75)


def test_yes_no_and_scale_score_each_trajectory_from_one_bound_first_token(judge_server, make_rollout, tmp_path):
    def respond(body, headers):
        right = shown(body) == ["82"]
        if body["response_format"]["json_schema"]["schema"] == {"type": "boolean"}:
            return top_reply({"true": 0.9, "false": 0.1} if right else {"t": 0.1, "f": 0.3, "false": 0.6})
        return top_reply({"5": 0.6, "4": 0.4} if right else {"1": 0.5, "2": 0.5})

    judge_server.respond = respond
    rollouts = group(make_rollout, ["82", "81", "eighty"])
    yes_no = compute(spec(judge_server.url, "yes_no", cache_dir=str(tmp_path / "cache")), rollouts)
    assert [o.value for o in yes_no] == pytest.approx([0.9, 0.1, 0.1])
    assert yes_no[0].details["judge_mode"] == "yes_no" and yes_no[0].details["group_usage"]["requests"] == 3
    for request in judge_server.requests:  # one token's distribution per trajectory: no reply is generated
        body = request["body"]
        assert (body["max_tokens"], body["logprobs"], body["top_logprobs"]) == (1, True, 20)
        assert body["response_format"] == choice_format("yes_no") and len(shown(body)) == 1
    scale = compute(spec(judge_server.url, "scale"), rollouts)
    assert [o.value for o in scale] == pytest.approx([0.9, 0.125, 0.125])

    judge_server.requests.clear()
    again = compute(spec(judge_server.url, "yes_no", cache_dir=str(tmp_path / "cache")), rollouts)
    assert [o.value for o in again] == [o.value for o in yes_no] and judge_server.requests == []  # from the cache
    assert again[0].details["group_usage"]["cache_hits"] == 3


def test_pairwise_asks_both_orders_and_cancels_a_position_bias(judge_server, make_rollout):
    quality = {"82": 1.0, "81": 0.0, "80": 0.0}

    def respond(body, headers):  # prefers the better one by 0.3, and whatever is shown first by 0.2
        a, b = shown(body)
        p1 = min(1.0, max(0.0, 0.5 + 0.3 * (quality[a] - quality[b]) + 0.2))
        return top_reply({"1": max(p1, 1e-9), "2": max(1.0 - p1, 1e-9)})

    judge_server.respond = respond
    outs = compute(spec(judge_server.url, "pairwise"), group(make_rollout, ["82", "81", "80"]))
    assert len(judge_server.requests) == 6  # every ordered pair
    assert {tuple(shown(r["body"])) for r in judge_server.requests} == {
        (a, b) for a in quality for b in quality if a != b}
    # the right answer beats each wrong one with (1.0 + 0.6) / 2; the wrong ones tie with each other: 0.5
    assert [o.value for o in outs] == pytest.approx([0.8, (0.2 + 0.5) / 2, (0.2 + 0.5) / 2])
    assert outs[0].details["win_probs"] == pytest.approx([0.8, 0.8])
    assert outs[1].details["order_agreement"] == 0.5  # against "80" the first-shown one wins either way
    (alone,) = compute(spec(judge_server.url, "pairwise"), group(make_rollout, ["82"]))  # an evaluation's group of one
    assert (alone.value, alone.error, alone.applicable) == (None, None, False) and len(judge_server.requests) == 6


def test_a_judge_without_log_probs_or_choices_fails_the_group_with_the_reason(judge_server, make_rollout):
    rollouts = group(make_rollout, ["82", "81"])
    judge_server.script(top_reply({"The": 0.7, "I": 0.3}))
    outs = compute(spec(judge_server.url, "yes_no"), rollouts)
    assert all(o.value is None and "none of the judge's likely first tokens ('The', 'I')" in o.error for o in outs)
    judge_server.script((400, {"error": {"message": "logprobs are not supported by this model"}}, 0.0))
    outs = compute(spec(judge_server.url, "scale", max_retries=0), rollouts)
    assert all("does not give first-token log-probs" in o.error and "mode: ranking" in o.error for o in outs)
    assert all("must be one of ranking, yes_no, scale, pairwise" in o.error
               for o in compute(spec(judge_server.url, "vote"), rollouts))


def test_the_judges_weights_enter_the_version_and_the_cache_by_content(tmp_path, judge_server, make_rollout):
    weights = tmp_path / "judge"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"one")
    params = {"base_url": "http://127.0.0.1:9/v1", "model": "judge", "weights": str(weights)}
    first = reward_version(RewardSpec(fn="rewards.ruler.ruler_reward", params=params))
    assert reward_version(RewardSpec(fn="rewards.ruler.ruler_reward", params=params)) == first
    judge_server.script(top_reply({"true": 0.9, "false": 0.1}))
    cached = spec(judge_server.url, "yes_no", weights=str(weights), cache_dir=str(tmp_path / "cache"))
    rollouts = group(make_rollout, ["82", "81"])
    assert [o.value for o in compute(cached, rollouts)] == pytest.approx([0.9, 0.9])
    assert [o.value for o in compute(cached, rollouts)] == pytest.approx([0.9, 0.9]) and len(judge_server.requests) == 2

    (weights / "model.safetensors").write_bytes(b"two")
    assert reward_version(RewardSpec(fn="rewards.ruler.ruler_reward", params=params)) != first
    judge_server.script(top_reply({"true": 0.2, "false": 0.8}))  # other weights: asked again, not read from the cache
    assert [o.value for o in compute(cached, rollouts)] == pytest.approx([0.2, 0.2]) and len(judge_server.requests) == 4


@pytest.mark.slow
def test_a_real_model_behind_rlops_serve_scores_a_group_without_generating(tmp_path, tiny_model_dir):
    from tests.flows.test_ruler_step import served_judge
    from tests.rewards.test_ruler_schema import trajectories

    with served_judge(tiny_model_dir, tmp_path / "judge-ws") as judge:
        client = OpenAIClient(judge.url, "base", max_retries=0)
        for mode, requests in (("yes_no", 4), ("scale", 4), ("pairwise", 12)):
            judge.requests.clear()
            usage = Usage()
            scores = judge_group(trajectories(4), mode, client, on_cost=usage.add)
            assert len(scores) == 4 and all(0.0 <= s <= 1.0 for s, _ in scores)
            assert usage.requests == len(judge.requests) == requests
            assert all(r["usage"]["completion_tokens"] == 1 for r in judge.requests)  # the prefill's token alone
            if mode != "pairwise":
                assert all(sum(d["choice_probs"].values()) == pytest.approx(1.0) for _, d in scores)


def test_a_local_judge_reads_the_choices_from_one_forward_pass(tiny_model_dir, monkeypatch):
    from tests.rewards.test_ruler_schema import trajectories

    client = TransformersClient(str(tiny_model_dir))
    monkeypatch.setattr(client._lm, "generate", lambda *a, **k: pytest.fail("the log-prob modes never generate"))
    scores = judge_group(trajectories(3), "yes_no", client)
    assert len(scores) == 3 and all(0.0 < s < 1.0 for s, _ in scores)  # a random model: between the choices
    assert all(set(d["choice_probs"]) <= {"true", "false", "yes", "no"} for _, d in scores)
    assert [s for s, _ in judge_group(trajectories(3), "yes_no", client)] == [s for s, _ in scores]


def test_a_wrong_mode_is_a_config_problem_before_any_compute():
    from flows.config import read_yaml
    from flows.run_config import from_dict, semantic_problems

    data = read_yaml(Path(__file__).parents[2] / "configs" / "arithmetic_judge.yaml")
    (judge,) = [r for r in data["score"]["rewards"] if r["name"] == "judge"]
    assert semantic_problems(from_dict(data)) == []
    judge["params"].update(mode="vote")
    assert any("mode must be one of ranking, yes_no, scale, pairwise, got 'vote'" in p
               for p in semantic_problems(from_dict(data)))
    judge["params"].update(mode="pairwise", permutations=2)
    assert any("permutations is the ranking mode's" in p for p in semantic_problems(from_dict(data)))
