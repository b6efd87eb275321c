"""A judge served by `rlops serve`: a group's pointwise requests (the instructions, the rubric and the shared
conversation, then each answer) arrive together, are generated in one batch, and their common prefix is prefilled
once (stages/policy/hf.py, `_prefix_prefill`). The scores are the ones a full prefill per request gives."""

from __future__ import annotations

import pytest

from rewards.judge_client import OpenAIClient
from rewards.judge_modes import judge_group
from stages.policy.hf import HFBackend
from stages.service.resolve import fixed_resolver
from stages.service.service import ServiceConfig
from tests.service_fixtures import serving

SYSTEM = {"role": "system", "content": "Solve the arithmetic problem. Reply with the number only."}
QUESTION = {"role": "user", "content": "What is 3 + 4?"}
ANSWERS = ["7", "8", "seven", "The answer is 7."]


def test_a_groups_requests_share_their_prefix_and_score_as_without_it(scripted_policy, monkeypatch) -> None:
    prefills: list[tuple[int, bool]] = []
    real = HFBackend._prefix_prefill

    def counted(self, prompts, width):
        cache = real(self, prompts, width)
        prefills.append((len(prompts), cache is not None))
        return cache

    monkeypatch.setattr(HFBackend, "_prefix_prefill", counted)
    group = [[SYSTEM, QUESTION, {"role": "assistant", "content": a}] for a in ANSWERS]
    backend = scripted_policy.backend
    scores, seen = {}, {}
    # a window long enough that the group's four requests, sent together, share one generate call
    with serving(scripted_policy, fixed_resolver("base", None), ServiceConfig(batch_window_s=0.5)) as service:
        client = OpenAIClient(service.url + "/v1", "base", concurrency=len(ANSWERS), timeout=120, max_retries=0)
        for share in (False, True):
            monkeypatch.setattr(backend, "share_prefix", share)
            prefills.clear()
            scores[share] = [value for value, _ in judge_group(group, "yes_no", client, concurrency=len(ANSWERS))]
            seen[share] = list(prefills)
    assert seen[False] == []  # every request prefilled whole
    assert seen[True] == [(len(ANSWERS), True)]  # one batch of the four: their common prefix run once
    assert all(0.0 <= s <= 1.0 for s in scores[True])
    assert scores[True] == pytest.approx(scores[False], abs=1e-4)
