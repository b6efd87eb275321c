"""What a GRPO update reads: the scored rollouts of some batches, turned into training samples and
group-relative advantages.

    data = training_data(read_scored(ws, batches, RewardRef("correct", "1a2b...")), scale="group", baseline="mean")
    data.samples, data.advantages, data.temperature, data.metrics

Rows without a reward value (unscored, or the reward failed on them) are dropped before the group
statistics; groups whose rewards all agree carry no signal and are skipped (counted in the metrics).
The sampling temperature is read from the rollouts themselves (every rollout records it), so the
importance ratio is computed at exactly the temperature the behaviour log-probs were taken at.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stages.reward_ref import RewardRef
from storage.schema import segment_bounds
from storage.workspace import Workspace

if TYPE_CHECKING:
    import torch

    from stages.policy.vlm import VisualSample, VLMPolicy


@dataclass(frozen=True)
class Sample:
    """What training needs of a rollout: tokens, which were sampled, and their behaviour log-probs."""

    token_ids: list[int]
    loss_mask: list[int]  # 1 = sampled by the policy (trained on)
    behavior_logprobs: list[float]  # aligned with token_ids; used where loss_mask is 1
    # A vision-language policy's sample: its image tensors and suppressed ids (stages.policy.vlm.VisionInputs),
    # fed to the forward pass with the tokens; None for a text model.
    vision: Any = None
    # The teacher's log-probs of the same tokens (on-policy distillation, stages/update/distill.py), else None.
    teacher_logprobs: list[float] | None = None


def visual_training_sample(policy: VLMPolicy, sample: VisualSample) -> Sample:
    """A vision-language policy's recorded sample as the update trains on it: the recorded tokens and
    log-probs, with the pixel inputs rebuilt from the workspace's stored images (stages/policy/vlm.py)."""
    return Sample(sample.token_ids, sample.loss_mask, sample.behavior_logprobs,
                  vision=policy.vision_inputs(sample.image_ids, sample.processor))


@dataclass
class TrainingData:
    samples: list[Sample]  # the segments (usually one per rollout) of the rollouts of groups with signal
    advantages: torch.Tensor  # (n,) one per sample: its rollout's advantage
    temperature: float  # the rollouts' sampling temperature
    metrics: dict[str, float]  # reward mean/std, advantage stats, group counts


def pixel_inputs(policy: VLMPolicy) -> Callable[[dict[str, Any]], Any]:
    """A scored row's pixel inputs (`stages.policy.vlm.VisionInputs`), rebuilt from the workspace's stored images
    (`image_ids`) by `policy`'s processor, once per distinct (images, processor); ValueError when the row records
    another processor (rollouts.sampling's `processor`, written by the rollout stage): its pixels would differ from
    what the policy saw."""

    built: dict[tuple, Any] = {}  # rows showing the same images share one object: a group's are sent once per rank

    def rebuild(row: dict[str, Any]) -> Any:
        recorded = json.loads(row["sampling"] or "{}").get("processor")
        key = (tuple(row["image_ids"] or ()), recorded)
        if key not in built:
            built[key] = policy.vision_inputs(list(key[0]), recorded)
        return built[key]

    return rebuild


def read_scored(ws: Workspace, batches: list[str], reward: RewardRef, images: bool = False) -> list[dict[str, Any]]:
    """One row per rollout of the batches with its `reward` value (None: unscored or errored);
    the latest score wins if a reward version was written twice. `images`: with the rows' `image_ids`
    (left out otherwise, so a workspace of files older than that column still reads)."""
    missing = [b for b in batches if ws.catalog.get_artifact(b) is None]
    if missing:
        raise KeyError(f"rollout batches not complete or unknown: {missing}")
    return ws.query("""
        WITH r AS (
            SELECT rollout_id, value FROM rewards
            WHERE reward_name = $name AND reward_version = $version AND list_contains($batches, batch_id)
            QUALIFY row_number() OVER (PARTITION BY rollout_id ORDER BY scored_at DESC) = 1)
        SELECT ro.rollout_id, ro.batch_id, ro.group_id, ro.token_ids, ro.loss_mask, ro.behavior_logprobs,
               ro.segment_starts, ro.sampling, ro.truncated, r.value""" + (", ro.image_ids" if images else "") + """
        FROM rollouts ro LEFT JOIN r USING (rollout_id)
        WHERE list_contains($batches, ro.batch_id)
        ORDER BY ro.batch_id, ro.group_id, ro.sample_idx""",
        {"name": reward.name, "version": reward.version, "batches": list(batches)}).to_pylist()


def sampling_temperature(rows: list[dict[str, Any]]) -> float:
    """The one temperature the rows were sampled at (ValueError if they disagree)."""
    temps = {float(json.loads(r["sampling"] or "{}").get("temperature", 1.0)) for r in rows}
    if len(temps) != 1:
        raise ValueError(f"the rollouts were sampled at several temperatures {sorted(temps)}: "
                         "one update needs one (the importance ratio is taken at it)")
    return temps.pop()


def training_data(rows: list[dict[str, Any]], scale: str, baseline: str, skip_zero_variance: bool = True,
                  vision: Callable[[dict[str, Any]], Any] | None = None, mask_truncated: bool = False) -> TrainingData:
    """Scored rows -> samples of the groups with signal (of every group, `skip_zero_variance` off),
    their advantages and the data metrics. `vision` (`pixel_inputs`): a vision-language policy's samples
    carry the pixel inputs of their rows. `mask_truncated` (DAPO's overlong filtering): a rollout cut at the
    token budget counts in its group's baseline and scale but trains nothing (`masked_truncated` counts them)."""
    import torch

    from stages.update.loss import group_advantages, zero_variance_groups

    if not rows:
        raise ValueError("the batches hold no rollouts")
    temperature = sampling_temperature(rows)
    scored = [r for r in rows if r["value"] is not None]
    if not scored:
        raise ValueError("no rollout of these batches has a value for this reward")
    rewards = torch.tensor([r["value"] for r in scored], dtype=torch.float32)  # (N,)
    groups = [(r["batch_id"], r["group_id"]) for r in scored]
    zero = zero_variance_groups(rewards, groups)  # (N,) bool; their advantages are 0 anyway
    keep = ~zero if skip_zero_variance else torch.ones_like(zero)
    advantages = group_advantages(rewards, groups, scale, baseline)[keep]  # (n,) one per rollout with signal
    # Each segment of a rollout (storage.schema.segment_bounds) is its own sequence, trained with the
    # rollout's advantage; a segment with no sampled token (an agent's error row) trains nothing.
    samples, owner, masked = [], [], 0
    for j, r in enumerate(r for r, k in zip(scored, keep.tolist()) if k):
        if mask_truncated and r.get("truncated"):
            masked += 1
            continue
        bounds = segment_bounds(r.get("segment_starts"), len(r["token_ids"]))
        if vision is not None and len(bounds) > 1:  # which segment saw which image is not recorded
            raise ValueError(f"rollout {r['rollout_id']} has {len(bounds)} segments: a visual episode trains as one")
        pixels = vision(r) if vision is not None else None
        for a, b in bounds:
            if any(r["loss_mask"][a:b]):
                teacher = r.get("teacher_logprobs")
                samples.append(Sample(r["token_ids"][a:b], r["loss_mask"][a:b], r["behavior_logprobs"][a:b], pixels,
                                      teacher[a:b] if teacher is not None else None))
                owner.append(j)
    n_groups, n_zero = len(set(groups)), len({g for g, z in zip(groups, zero.tolist()) if z})
    return TrainingData(samples, advantages[torch.tensor(owner, dtype=torch.long)], temperature, {
        "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std(unbiased=False)),
        "advantage_mean": float(advantages.mean()) if samples else 0.0,
        "advantage_std": float(advantages.std(unbiased=False)) if samples else 0.0,
        "groups": float(n_groups), "zero_variance_groups": float(n_zero), "frac_zero_variance_groups": n_zero / n_groups,
        "dropped_null_rewards": float(len(rows) - len(scored)), "trained_rollouts": float(len(set(owner))),
        "trained_segments": float(len(samples)), "masked_truncated": float(masked),
    })


def informative_groups(ws: Workspace, batches: list[str], reward: RewardRef) -> int:
    """Groups of the batches whose scored `reward` values are not all equal: the ones GRPO learns from
    (the others get advantage 0; null rewards are left out, as in `training_data`)."""
    values: dict[str, set[float]] = {}
    for r in read_scored(ws, batches, reward):
        if r["value"] is not None:
            values.setdefault(r["group_id"], set()).add(r["value"])
    return sum(len(v) > 1 for v in values.values())



def staleness(ws: Workspace, parent_policy: str, batches: list[str]) -> int:
    """How many updates the policy being trained (`parent_policy`) is ahead of the oldest policy that
    generated `batches` (0: on-policy, as in a synchronous run): parent step - generating policy's step."""
    parent_step = ws.catalog.get_checkpoint(parent_policy)["step"]
    generators = {ws.catalog.get_artifact(b)["meta"].get("policy_id") for b in batches}
    steps = [ws.catalog.get_checkpoint(p)["step"] for p in generators if p and ws.catalog.get_checkpoint(p)]
    return max((parent_step - s for s in steps), default=0)
