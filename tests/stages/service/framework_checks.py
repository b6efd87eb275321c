"""What every framework test asserts about an episode the policy service recorded while a real agent
framework ran against it (tests/stages/service/test_frameworks*.py)."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.scripted_model import ANSWER, CALL


def episode(served: Any, episode_id: str) -> dict[str, Any]:
    """The episode as the service assembles it (GET /rlops/episodes/{id})."""
    r = httpx.get(f"{served.url}/rlops/episodes/{episode_id}", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def sampled_texts(tokenizer: Any, ep: dict[str, Any]) -> list[str]:
    """The recorded sampled tokens (mask 1), one decoded text per contiguous run, i.e. per model turn."""
    runs: list[list[int]] = []
    prev = 0
    for token, m in zip(ep["token_ids"], ep["loss_mask"]):
        if m and not prev:
            runs.append([])
        if m:
            runs[-1].append(token)
        prev = m
    return [tokenizer.decode(r, skip_special_tokens=False) for r in runs]


def assert_echo_recognised(served: Any, episode_id: str) -> None:
    """The second call's prompt was built from the first call's recorded turn: the framework's echo of
    it was recognised (recorder.chat_prompt puts the recorded message itself in the conversation).
    The one-segment check alone cannot show this: an unrecognised echo is rendered as the model wrote
    it (recorder.as_written), which this tokenizer happens to re-tokenize to the same ids here."""
    calls = served.recorder.peek(episode_id).calls
    first = calls[0].choices[calls[0].chosen].message
    assert any(m is first for m in calls[1].messages), f"{episode_id}: the echoed tool-call turn was not recognised"


def check_tool_episode(served: Any, episode_id: str, reported_output_tokens: int) -> dict[str, Any]:
    """The scripted tool-using episode was recorded token for token in one segment: (i) no new segment
    and the framework's echo of the tool-call turn recognised, (ii) the mask sums to the completion
    tokens the server reported in `usage` (as the framework saw them), (iii) the sampled tokens are the
    scripted `search` call, then the answer after the tool's result."""
    ep = episode(served, episode_id)
    assert ep["segment_starts"] == [], f"{episode_id}: the tool-call round trip started a new segment"
    assert ep["num_turns"] == 2
    assert_echo_recognised(served, episode_id)
    assert sum(ep["loss_mask"]) == reported_output_tokens
    call, answer = sampled_texts(served.policy.tokenizer, ep)
    assert f"<tool_call>{json.dumps(CALL)}</tool_call>" in call
    assert answer.removesuffix("<|im_end|>") == ANSWER
    return ep


def same_record(a: dict[str, Any], b: dict[str, Any]) -> None:
    """A streamed and a non-streamed run of the same (greedy) episode recorded the same tokens."""
    assert (a["token_ids"], a["loss_mask"], a["segment_starts"]) == (b["token_ids"], b["loss_mask"], b["segment_starts"])
    assert a["behavior_logprobs"] == b["behavior_logprobs"]
