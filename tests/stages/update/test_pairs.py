"""DPO's preference pairs, table-driven: ties, margins, best-vs-worst vs all pairs, and what each side keeps."""

from __future__ import annotations

import pytest

from stages.update.pairs import pair_indices, preference_pairs


@pytest.mark.parametrize("values, pairing, margin, expected", [
    # best vs worst: one pair per group; the first of equal bests / worsts
    ([0.0, 1.0, 0.5], "best_worst", 0.0, [(1, 0)]),
    ([1.0, 0.0, 1.0, 0.0], "best_worst", 0.0, [(0, 1)]),
    ([0.3, 0.3, 0.3], "best_worst", 0.0, []),  # a tied group makes no pair
    ([0.7], "best_worst", 0.0, []),  # a singleton neither
    ([], "best_worst", 0.0, []),
    ([0.0, 0.4], "best_worst", 0.5, []),  # gap 0.4 < margin 0.5
    ([0.0, 0.5], "best_worst", 0.5, [(1, 0)]),  # the margin itself is enough
    # all pairs: every ordered (higher, lower), ties skipped
    ([0.0, 1.0, 0.5], "all", 0.0, [(1, 0), (1, 2), (2, 0)]),
    ([1.0, 1.0, 0.0], "all", 0.0, [(0, 2), (1, 2)]),  # 0 vs 1 tie: no pair
    ([0.0, 1.0, 0.5], "all", 0.6, [(1, 0)]),  # 0.5 gaps dropped
    ([0.2, 0.2], "all", 0.0, []),
])
def test_pair_indices(values, pairing, margin, expected) -> None:
    assert pair_indices(values, pairing, margin) == expected


@pytest.mark.parametrize("pairing, margin", [("best_worst", -0.1), ("some", 0.0)])
def test_bad_pairing_settings_are_refused(pairing, margin) -> None:
    with pytest.raises(ValueError):
        pair_indices([0.0, 1.0], pairing, margin)


def row(rid: str, group: str, value: float | None, tokens: list[int], mask: list[int], segments=()) -> dict:
    return {"rollout_id": rid, "batch_id": "b", "group_id": group, "token_ids": tokens, "loss_mask": mask,
            "value": value, "segment_starts": list(segments)}


def test_pairs_keep_exact_tokens_and_masks_per_group() -> None:
    prompt = [1, 2, 3]
    rows = [
        # group a: multi-turn; 7 8 is a tool result (mask 0) between two sampled turns
        row("a0", "a", 1.0, prompt + [5, 6, 7, 8, 9], [0, 0, 0, 1, 1, 0, 0, 1]),
        row("a1", "a", 0.0, prompt + [4, 10], [0, 0, 0, 1, 1]),
        row("a2", "a", None, prompt + [11], [0, 0, 0, 1]),  # unscored: left out
        # group b: all tied
        row("b0", "b", 0.5, [7, 7, 1], [0, 0, 1]), row("b1", "b", 0.5, [7, 7, 2], [0, 0, 1]),
        # group c: the better one is an external agent's multi-segment rollout: left out, so no pair
        row("c0", "c", 1.0, [3, 4, 5, 3, 4, 6], [0, 0, 1, 0, 0, 1], segments=[3]), row("c1", "c", 0.0, [3, 4, 9], [0, 0, 1]),
    ]
    pairs, m = preference_pairs(rows, "best_worst")
    assert [(p.chosen_id, p.rejected_id, p.margin) for p in pairs] == [("a0", "a1", 1.0)]
    (p,) = pairs
    assert p.prompt_ids == prompt
    assert (p.chosen_ids, p.chosen_mask) == ([5, 6, 7, 8, 9], [1, 1, 0, 0, 1])
    assert (p.rejected_ids, p.rejected_mask) == ([4, 10], [1, 1])
    assert m == {"pairs": 1.0, "groups": 3.0, "groups_with_pairs": 1.0, "tied_groups": 2.0,
                 "dropped_null_rewards": 1.0, "dropped_multi_segment": 1.0, "dropped_prompt_mismatch": 0.0,
                 "pair_margin_mean": 1.0}


def test_samples_of_different_prompts_make_no_pair() -> None:
    rows = [row("x0", "g", 1.0, [1, 2, 5], [0, 0, 1]), row("x1", "g", 0.0, [1, 3, 5], [0, 0, 1])]
    pairs, m = preference_pairs(rows, "all")
    assert pairs == [] and m["dropped_prompt_mismatch"] == 1.0
