"""Verdicts valid by construction: the judge's request carries the group's verdict schema, and a real model behind
`rlops serve` (the tiny random Llama with SmolLM2's tokenizer, constrained decoding) answers every group with exactly
the ids it was given, scores in [0, 1], without a correction retry. And the reference-guided request."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from rewards.base import RewardSpec, compute
from rewards.judge_client import OpenAIClient
from rewards.ruler import REFERENCE, Usage, rank, verdict_format
from storage.schema import Message
from tests.flows.test_ruler_step import served_judge

pytestmark = pytest.mark.slow  # a served tiny model generating constrained JSON: a few seconds


def trajectories(n: int) -> list[list[dict[str, str]]]:
    question = {"role": "user", "content": "What is 40 + 42?"}
    return [[question, {"role": "assistant", "content": answer}] for answer in ["82", "81", "80 + 2", "I think 82",
                                                                               "no idea"][:n]]


def test_a_real_model_behind_rlops_serve_gives_schema_valid_verdicts_with_the_given_ids(tmp_path: Path,
                                                                                       tiny_model_dir: Path):
    with served_judge(tiny_model_dir, tmp_path / "judge-ws") as judge:
        client = OpenAIClient(judge.url, "base", max_tokens=1500, max_retries=0)
        usage = Usage()
        for n in (2, 3, 5):
            ids = [f"ro-{n}-{i}" for i in range(n)]
            verdicts = rank(trajectories(n), None, client, ids=ids, usage=usage)
            assert [v.id for v in verdicts] == ids
            assert all(0.0 <= v.score <= 1.0 and v.schema_bound for v in verdicts)
    assert usage.requests == len(judge.requests) == 3  # one request per group: no reply needed a correction
    for n, request in zip((2, 3, 5), judge.requests):  # what the random model wrote follows the schema exactly
        reply = json.loads(request["reply"])
        jsonschema.validate(reply, verdict_format(n)["json_schema"]["schema"])
        assert [entry["id"] for entry in reply["scores"]] == [str(i) for i in range(1, n + 1)]


def test_the_judge_sees_the_reference_when_asked(judge_server, make_rollout):
    def respond(body, headers):
        return judge_server.ok(json.dumps({"scores": [{"id": "1", "score": 1.0}, {"id": "2", "score": 0.0}]}))

    judge_server.respond = respond
    group = [make_rollout([Message("assistant", a)], {"answer": 82, "alt": "eighty-two"}, sample_idx=i)
             for i, a in enumerate(["82", "81"])]
    base = {"base_url": judge_server.url, "model": "judge-model", "timeout": 5.0, "max_retries": 0}
    for reference, shown in ((True, "82"), ("alt", "eighty-two")):
        judge_server.requests.clear()
        outs = compute(RewardSpec(fn="rewards.ruler.ruler_reward", params={**base, "reference": reference}), group)
        assert [o.value for o in outs] == [1.0, 0.0]
        assert outs[0].details["reference"] == ("answer" if reference is True else reference)
        body = judge_server.requests[0]["body"]
        assert body["messages"][1]["content"].startswith(f"<reference>\n{shown}\n</reference>")
        assert body["messages"][0]["content"].endswith(REFERENCE)
    judge_server.requests.clear()
    plain = compute(RewardSpec(fn="rewards.ruler.ruler_reward", params=base), group)
    assert "<reference>" not in judge_server.requests[0]["body"]["messages"][1]["content"]
    assert plain[0].value == 1.0 and "reference" not in plain[0].details
    missing = compute(RewardSpec(fn="rewards.ruler.ruler_reward", params={**base, "reference": "gold"}), group)
    assert all(o.value is None and "no 'gold'" in o.error for o in missing)
