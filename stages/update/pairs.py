"""Preference pairs from scored groups, for DPO: chosen vs rejected samples of one prompt under one reward.

    pairs, metrics = preference_pairs(read_scored(ws, batches, reward), pairing="best_worst", min_margin=0.0)

A group's samples continue one prompt, so any two of them with different rewards make a pair: the higher
reward is chosen. Ties never make a pair (DPO would push two equally good answers apart); `min_margin`
drops pairs whose rewards differ by less. `pairing` picks which pairs of a group:

- "best_worst": one pair per group, its best vs its worst sample (the first of equals, by sample order);
- "all": every ordered pair (i, j) with reward_i - reward_j >= the margin.

Each side keeps its rollout's exact tokens and loss mask: the prompt is what both share before the first
sampled token; the completion is the rest, multi-turn included, with tool results at mask 0, so they
never enter the loss. Rollouts recorded as several segments (an external agent rewriting its history) are
left out: a DPO response must be one sequence. Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Pairing = Literal["best_worst", "all"]


@dataclass(frozen=True)
class PreferencePair:
    """One DPO example in tokens: `prompt_ids` then each completion; a mask of 1 marks sampled tokens."""

    chosen_id: str  # rollout ids, for lineage and tests
    rejected_id: str
    margin: float  # reward(chosen) - reward(rejected) > 0
    prompt_ids: list[int]
    chosen_ids: list[int]
    chosen_mask: list[int]
    rejected_ids: list[int]
    rejected_mask: list[int]

    def as_example(self) -> dict[str, Any]:
        """The row TRL's preference collator reads (plus the masks, which `MaskedPreferenceCollator` applies, and
        the rollout ids, by which it finds a vision-language pair's pixel inputs)."""
        return {"prompt_ids": self.prompt_ids, "chosen_ids": self.chosen_ids, "rejected_ids": self.rejected_ids,
                "chosen_mask": self.chosen_mask, "rejected_mask": self.rejected_mask,
                "chosen_id": self.chosen_id, "rejected_id": self.rejected_id}


def pair_indices(values: list[float], pairing: Pairing, min_margin: float) -> list[tuple[int, int]]:
    """(chosen, rejected) positions among one group's reward `values`: reward differs (no ties) by at least
    `min_margin`; "best_worst" gives at most one pair, "all" every qualifying ordered pair."""
    if min_margin < 0:
        raise ValueError(f"min_margin must be >= 0, got {min_margin}")
    if pairing == "best_worst":
        if not values:
            return []
        best = max(range(len(values)), key=lambda i: (values[i], -i))  # the first of equal bests
        worst = min(range(len(values)), key=lambda i: (values[i], i))
        gap = values[best] - values[worst]
        return [(best, worst)] if gap > 0 and gap >= min_margin else []
    if pairing == "all":
        return [(i, j) for i in range(len(values)) for j in range(len(values))
                if values[i] - values[j] > 0 and values[i] - values[j] >= min_margin]
    raise ValueError(f"unknown pairing {pairing!r}: best_worst or all")


def _prompt_length(loss_mask: list[int]) -> int:
    return next((t for t, m in enumerate(loss_mask) if m), len(loss_mask))


def preference_pairs(rows: list[dict[str, Any]], pairing: Pairing = "best_worst",
                     min_margin: float = 0.0) -> tuple[list[PreferencePair], dict[str, float]]:
    """Pairs of the scored rows (`stages.update.data.read_scored`, ordered by batch, group, sample) and counts:
    groups, groups with a pair, tied groups, rows without a value, multi-segment rows left out."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    null = segmented = 0
    for r in rows:
        if r["value"] is None:
            null += 1
        elif r.get("segment_starts"):
            segmented += 1
        elif any(r["loss_mask"]):
            groups.setdefault((r["batch_id"], r["group_id"]), []).append(r)
    pairs: list[PreferencePair] = []
    with_pair = tied = mismatched = 0
    for members in groups.values():
        values = [float(m["value"]) for m in members]
        tied += len(set(values)) == 1
        found = 0
        for i, j in pair_indices(values, pairing, min_margin):
            c, r = members[i], members[j]
            p = min(_prompt_length(c["loss_mask"]), _prompt_length(r["loss_mask"]))
            if c["token_ids"][:p] != r["token_ids"][:p]:  # not one prompt: no preference between them
                mismatched += 1
                continue
            pairs.append(PreferencePair(c["rollout_id"], r["rollout_id"], values[i] - values[j], list(c["token_ids"][:p]),
                                        list(c["token_ids"][p:]), list(c["loss_mask"][p:]),
                                        list(r["token_ids"][p:]), list(r["loss_mask"][p:])))
            found += 1
        with_pair += found > 0
    return pairs, {"pairs": float(len(pairs)), "groups": float(len(groups)), "groups_with_pairs": float(with_pair),
                   "tied_groups": float(tied), "dropped_null_rewards": float(null),
                   "dropped_multi_segment": float(segmented), "dropped_prompt_mismatch": float(mismatched),
                   "pair_margin_mean": sum(p.margin for p in pairs) / len(pairs) if pairs else 0.0}
