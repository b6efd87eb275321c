"""GRPO trains every segment of a multi-segment rollout with the episode's advantage."""

from __future__ import annotations

import json

import pytest
import torch

from stages.update.data import training_data


def _row(group: str, value: float | None, ids: list[int], mask: list[int], starts: list[int] | None) -> dict:
    return {"rollout_id": f"{group}-{value}-{len(ids)}", "batch_id": "b", "group_id": group, "token_ids": ids,
            "loss_mask": mask, "behavior_logprobs": [-0.5 * m for m in mask], "segment_starts": starts,
            "sampling": json.dumps({"temperature": 1.0}), "value": value}


def test_segments_become_samples_with_their_episode_advantage():
    rows = [
        # two segments: [1 2 | 3 4] and [5 6 7 | 8]; every sampled token in one of them
        _row("g0", 1.0, [1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 1, 1, 0, 0, 0, 1], [4]),
        _row("g0", 0.0, [1, 2, 9], [0, 0, 1], []),  # one segment (a built-in rollout)
        _row("g0", 0.0, [], [], []),  # an agent that raised: scored, part of the baseline, nothing to train
        _row("g1", 1.0, [1, 2, 3], [0, 0, 1], None),  # a version-1 file: no column, one segment
        _row("g1", 0.0, [1, 2, 4, 5, 6], [0, 0, 1, 0, 0], [3]),  # the second segment samples nothing
    ]
    data = training_data(rows, scale="none", baseline="mean")
    samples, advantages, metrics = data.samples, data.advantages, data.metrics
    assert [s.token_ids for s in samples] == [[1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 9], [1, 2, 3], [1, 2, 4]]
    assert [s.loss_mask for s in samples] == [[0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 1], [0, 0, 1], [0, 0, 1]]
    assert samples[1].behavior_logprobs == [0.0, 0.0, 0.0, -0.5]  # aligned with the segment's tokens
    # group g0: rewards 1, 0, 0 -> mean 1/3; g1: 1, 0 -> mean 1/2 (no std scaling)
    assert advantages.tolist() == pytest.approx([2 / 3, 2 / 3, -1 / 3, 0.5, -0.5])
    assert metrics["trained_rollouts"] == 4 and metrics["trained_segments"] == 5
    sampled = sum(sum(r["loss_mask"]) for r in rows)
    assert sum(sum(s.loss_mask) for s in samples) == sampled  # no sampled token lost or duplicated


def test_a_two_segment_rollout_trains_like_its_segments_as_separate_rollouts(tiny_model_dir):
    """The loss over a segmented rollout is the loss over its segments as independent sequences (each
    from position 0, not one long sequence where the second segment would attend to the first)."""
    from stages.policy.load import load_policy
    from stages.policy.logprobs import token_logprobs
    from stages.update.train import _micro_batches

    model, _ = load_policy(str(tiny_model_dir))
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    rows = [_row("g0", 1.0, ids, [0, 0, 1, 1, 0, 0, 1, 1], [4]), _row("g0", 0.0, [1, 2, 9], [0, 0, 1], [])]
    samples = training_data(rows, scale="group", baseline="mean").samples
    (batch,) = _micro_batches(samples, 8, torch.device("cpu"))
    with torch.no_grad():
        logp = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.mask)
        alone = token_logprobs(model, torch.tensor([[5, 6, 7, 8]]), torch.ones(1, 4, dtype=torch.long))
        joined = token_logprobs(model, torch.tensor([ids]), torch.ones(1, 8, dtype=torch.long))
    row = next(i for i, j in enumerate(batch.index.tolist()) if samples[j].token_ids == [5, 6, 7, 8])
    assert torch.allclose(logp[row, 2:4], alone[0, 2:4])
    assert not torch.allclose(alone[0, 2:4], joined[0, 6:8])  # the context differs, so segments matter
