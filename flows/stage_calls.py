"""One stage on its own, with its inputs named as on the command line (`rlops stage ...`)."""

from __future__ import annotations


from flows import pipeline
from flows.run_config import RunConfig
from stages import dpo, evaluate, grpo, rm, rollout, score, sft
from stages.common import ArtifactRef, StageContext, base_policy
from rewards.base import RewardSpec
from stages.reward_ref import RewardRef

STAGES = ("sft", "rollout", "score", "grpo", "dpo", "rm", "evaluate")


def resolve_policy_arg(cfg: RunConfig, ctx: StageContext, policy: str | None) -> str:
    """`base` (or nothing) means the config's base model; anything else is a policy id."""
    return base_policy(ctx.ws, cfg.base_model) if policy in (None, "base") else policy


def call_stage(stage: str, cfg: RunConfig, ctx: StageContext, call: pipeline.Call = pipeline.direct,
               policy: str | None = None, rollouts: list[str] | None = None, reward: str | None = None,
               data: str | None = None, step: int = 0, split: str = "train", labels: bool = False,
               reviewer: str | None = None) -> ArtifactRef:
    """Run one stage from a pipeline config and named inputs; returns its artifact. `labels` (dpo): train on
    people's labels instead of a configured reward (`from_labels`), only `reviewer`'s when given."""
    if stage == "sft":
        if cfg.sft is None and data is None:
            raise ValueError("the config has no sft section: add one or pass --data")
        return call("sft", sft.run, cfg.sft or sft.SFTConfig(), ctx, base_model=cfg.base_model,
                    data=data or pipeline.sft_data(cfg, ctx.ws.root))
    if stage == "rollout":
        return call(f"rollout-{step}", rollout.run, cfg.rollout, ctx, policy_id=resolve_policy_arg(cfg, ctx, policy),
                    task=cfg.task, split=split, step=step)
    if stage == "score":
        if not rollouts:
            raise ValueError("score needs --rollouts BATCH_ID [...]")
        return call("score", score.run, cfg.score, ctx, batches=rollouts)
    if stage == "grpo":
        if not rollouts:
            raise ValueError("grpo needs --rollouts BATCH_ID [...]")
        return call("grpo", grpo.run, cfg.grpo, ctx, parent_policy=resolve_policy_arg(cfg, ctx, policy),
                    batches=rollouts, reward=RewardRef.parse(reward or cfg.reward_name))
    if stage in ("dpo", "rm"):  # the config's `dpo:` (`rm:`) section, whatever its `algorithm:`
        if labels:
            rollouts, ref = from_labels(ctx, rollouts, reviewer, call)
        elif not rollouts:
            raise ValueError(f"{stage} needs --rollouts BATCH_ID [...] (or --labels: the batches people labelled)")
        else:
            ref = RewardRef.parse(reward or cfg.reward_name)
        if stage == "rm":  # a reward model on the base model (`--policy` names another base), not on a policy
            return call("rm", rm.run, cfg.rm, ctx, base_policy=base_policy(ctx.ws, cfg.base_model) if policy in (None, "base")
                        else policy, batches=rollouts, reward=ref)
        return call("dpo", dpo.run, cfg.dpo, ctx, parent_policy=resolve_policy_arg(cfg, ctx, policy),
                    batches=rollouts, reward=ref)
    if stage == "evaluate":
        return call("evaluate", evaluate.run, cfg.eval, ctx, policy_id=resolve_policy_arg(cfg, ctx, policy),
                    task=cfg.task, rollout_config=cfg.rollout, score_config=cfg.score)
    raise ValueError(f"unknown stage {stage!r}; one of {', '.join(STAGES)}")


def from_labels(ctx: StageContext, batches: list[str] | None, reviewer: str | None,
                call: pipeline.Call = pipeline.direct) -> tuple[list[str], RewardRef]:
    """The batches to train on people's labels (the given ones, else every batch with a current label, of `reviewer`
    when given) and the `human` reward (rewards/human.py) scored on them: a person's ordering of a group is its
    episodes' values (best 1, worst 0), so DPO's pairs are the preferences it states, and the checkpoint's lineage
    names the `human` version, which names the labels. ValueError when there are no labels to train on."""
    if not batches:
        batches = [r["batch_id"] for r in ctx.ws.query(
            "SELECT DISTINCT batch_id FROM label_values WHERE $reviewer IS NULL OR reviewer = $reviewer ORDER BY 1",
            {"reviewer": reviewer}).to_pylist()]
    if not batches:
        raise ValueError("no labels" + (f" by {reviewer!r}" if reviewer else "") + " in this workspace: "
                         "label episodes with `rlops review RUN` first")
    spec = RewardSpec(name="human", fn="rewards.human.human", params={"reviewers": [reviewer]} if reviewer else {})
    scored = call("score-labels", score.run, score.ScoreConfig(rewards=[spec], total=None), ctx, batches=batches)
    return batches, RewardRef("human", ctx.ws.catalog.get_artifact(scored.id)["meta"]["rewards"]["human"])
