"""Episode assembly from recorded calls: one segment when prompts extend, segments otherwise, and
every sampled token masked 1 exactly once with its log-prob (no model needed)."""

from __future__ import annotations

import pytest

from stages.service.recorder import Call, Completion, EpisodeLog, assemble
from storage.schema import Message, segment_bounds


def _call(prompt: list[int], *choices: list[int]) -> Call:
    """A call whose choice i sampled choices[i], with log-probs -(token id)/100 to check alignment."""
    return Call([], [Completion(prompt, list(c), [-t / 100 for t in c], Message("assistant", "x"), "stop")
                     for c in choices])


def _check(log: EpisodeLog, expected_starts: list[int]) -> None:
    t = assemble(log)
    assert t.segment_starts == expected_starts
    assert len(t.token_ids) == len(t.loss_mask) == len(t.behavior_logprobs)
    sampled = [tok for call in log.calls for tok in call.choices[call.chosen].token_ids]
    # Every sampled token once with mask 1, in call order, with its own log-prob; 0 everywhere else.
    assert [tok for tok, m in zip(t.token_ids, t.loss_mask) if m] == sampled
    assert [lp for lp, m in zip(t.behavior_logprobs, t.loss_mask) if m] == [-tok / 100 for tok in sampled]
    assert all(lp == 0.0 for lp, m in zip(t.behavior_logprobs, t.loss_mask) if not m)
    # Each segment is a call's prompt followed by what it sampled (or several calls that extend it).
    for (a, b), first in zip(segment_bounds(t.segment_starts, len(t.token_ids)), _segment_first_calls(log, t)):
        assert t.token_ids[a : a + len(first.prompt_ids)] == first.prompt_ids
        assert t.loss_mask[a : a + len(first.prompt_ids)] == [0] * len(first.prompt_ids)


def _segment_first_calls(log: EpisodeLog, t) -> list[Completion]:
    firsts, segment = [], []
    for call in log.calls:
        c = call.choices[call.chosen]
        if not segment or c.prompt_ids[: len(segment)] != segment:
            firsts.append(c)
            segment = []
        segment = c.prompt_ids + c.token_ids if not segment else segment + c.prompt_ids[len(segment):] + c.token_ids
    return firsts


@pytest.mark.parametrize("calls, starts", [
    # prompts that extend the previous prompt + completion: one segment, one mask
    ([([1, 2], [10, 11]), ([1, 2, 10, 11, 3, 4], [12]), ([1, 2, 10, 11, 3, 4, 12, 5], [13, 14])], []),
    # the agent rewrote its history at call 2 (dropped its first turn): a new segment there
    ([([1, 2], [10, 11]), ([1, 2, 3], [12]), ([1, 2, 3, 12, 6], [13])], [4]),
    # call 3 goes back to call 1's branch: a third segment that holds call 1's tokens with mask 0
    ([([1, 2], [10, 11]), ([1, 2, 7], [12]), ([1, 2, 10, 11, 8], [13])], [4, 8]),
    # a single call
    ([([1, 2, 3], [10])], []),
])
def test_assembly_masks_every_sampled_token_once(calls, starts):
    log = EpisodeLog()
    for prompt, sampled in calls:
        log.calls.append(_call(prompt, sampled))
    _check(log, starts)


def test_the_continued_choice_of_an_n_call_is_the_one_trained():
    log = EpisodeLog()
    log.calls.append(_call([1, 2], [10, 11], [20, 21], [30]))
    log.calls[0].chosen = 1  # the next prompt reused choice 1 (chat_prompt marks it)
    log.calls.append(_call([1, 2, 20, 21, 5], [40]))
    t = assemble(log)
    assert t.token_ids == [1, 2, 20, 21, 5, 40] and t.loss_mask == [0, 0, 1, 1, 0, 1] and t.segment_starts == []
