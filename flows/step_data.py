"""What a step trains on beyond its own batch: which prompts it draws (the curriculum), which stored groups it
replays (the replay buffer), and where a forked run starts.

    prompts = curriculum_prompts(cfg, ctx, step, reward)   # None: the usual consecutive slice of the split
    extra = replay_batches(cfg, ctx, step, reward, batches)  # earlier batches of the run with signal, newest first
    policy, step = fork_point(ws, "my-run@20")             # or a checkpoint id, or RUN@latest

Both decisions are read from the catalog (the run's stored rollouts and rewards of the steps before this one),
never from memory (`cfg` is the run's flows.run_config.RunConfig, which imports this module's settings): a
restarted run rebuilds the same state, draws the same prompts and replays the same
batches, so its artifact ids are the ones the first attempt made (the prompts enter the rollout batch's id,
the replayed batches the update's inputs).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stages.common import StageContext
from stages.reward_ref import RewardRef
from storage.workspace import Workspace


class Curriculum(BaseModel):
    """Prompts chosen by their past pass rates in this run (DAPO-style filtering of what carries no signal):
    a prompt whose last `skip_solved` groups solved every sample is skipped, and one that `skip_unsolved` groups
    (or more) never solved once. The step walks the train split from its usual position and takes the first
    `prompts_per_step` prompts not skipped (fewer left: the skipped ones fill in, in the same order), so a run in
    which nothing is skipped draws exactly the prompts it draws without a curriculum."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = False
    solved_at: float = 1.0  # a sample solves its prompt when the train reward reaches this
    skip_solved: int | None = Field(1, ge=1)  # None: never skip solved prompts
    skip_unsolved: int | None = Field(None, ge=1)  # None: never skip unsolved prompts


class Replay(BaseModel):
    """A step whose batches hold fewer than `min_groups` groups with signal (rewards not all equal) also trains
    on the batches of the run's last `max_age` steps that have some, newest first, until it does. The replayed
    samples keep their recorded behaviour log-probs: the update's ratio is taken against them, so the clip (and
    `grpo.correction`, if set) bounds how far an older policy's samples move this one."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = False
    min_groups: int | None = Field(None, ge=1)  # groups with signal wanted per step; None: rollout.prompts_per_step
    max_age: int = Field(4, ge=1)  # replay batches of at most this many steps back


def past_batches(ws: Workspace, run_name: str, before: int, after: int = -1) -> list[tuple[int, str]]:
    """(step, batch id) of the run's training rollout batches of steps `after` < step < `before`, in step order:
    only what existed before the step being made, whatever a killed attempt left for later steps."""
    return [(r["step"], r["artifact_id"]) for r in ws.query(
        "SELECT a.artifact_id, CAST(a.meta->>'step' AS INTEGER) AS step FROM artifacts a "
        "WHERE a.kind = 'rollouts' AND a.meta->>'split' = 'train' AND a.artifact_id IN "
        "(SELECT artifact_id FROM stage_runs WHERE stage = 'rollout' AND run_name = ?) "
        "AND CAST(a.meta->>'step' AS INTEGER) < ? AND CAST(a.meta->>'step' AS INTEGER) > ? "
        "ORDER BY step, a.completed_at", [run_name, before, after]).to_pylist()]


def pass_rates(ws: Workspace, batches: list[str], reward: RewardRef, solved_at: float) -> dict[str, list[float]]:
    """Each prompt's pass rate (share of samples whose `reward` reached `solved_at`) per group, in batch order."""
    rows = ws.query("""
        WITH r AS (
            SELECT rollout_id, value FROM rewards
            WHERE reward_name = $name AND reward_version = $version AND list_contains($batches, batch_id)
            QUALIFY row_number() OVER (PARTITION BY rollout_id ORDER BY scored_at DESC) = 1)
        SELECT ro.prompt_id, ro.batch_id, avg(CASE WHEN r.value >= $solved THEN 1.0 ELSE 0.0 END) AS pass
        FROM rollouts ro JOIN r USING (rollout_id)
        WHERE list_contains($batches, ro.batch_id) AND r.value IS NOT NULL
        GROUP BY ro.prompt_id, ro.batch_id, ro.group_id""",
        {"name": reward.name, "version": reward.version, "batches": batches, "solved": solved_at}).to_pylist()
    order = {b: i for i, b in enumerate(batches)}
    history: dict[str, list[float]] = {}
    for r in sorted(rows, key=lambda r: order[r["batch_id"]]):
        history.setdefault(r["prompt_id"], []).append(float(r["pass"]))
    return history


def skipped(history: dict[str, list[float]], curriculum: Curriculum) -> set[str]:
    """The prompts the curriculum skips, given each one's pass rates (oldest first)."""
    out = set()
    for prompt, rates in history.items():
        k = curriculum.skip_solved
        if k and len(rates) >= k and all(x >= 1.0 for x in rates[-k:]):
            out.add(prompt)
        k = curriculum.skip_unsolved
        if k and len(rates) >= k and all(x <= 0.0 for x in rates):
            out.add(prompt)
    return out


def curriculum_prompts(cfg: Any, ctx: StageContext, step: int, reward: RewardRef) -> list[str] | None:
    """The prompt ids of `step` under `cfg.curriculum` (None when it is off): from the step's usual position in
    the train split, the first `prompts_per_step` prompts the run's earlier steps did not make skippable."""
    from tasks.base import load_task

    if not cfg.curriculum.enabled:
        return None
    prompts = [p.prompt_id for p in load_task(cfg.task.name, cfg.task.params).prompts("train")]
    n = cfg.rollout.prompts_per_step
    batches = [b for _, b in past_batches(ctx.ws, ctx.run_name, before=step)]
    skip = skipped(pass_rates(ctx.ws, batches, reward, cfg.curriculum.solved_at), cfg.curriculum) if batches else set()
    walk = [prompts[(step * n + i) % len(prompts)] for i in range(len(prompts))]
    chosen = [p for p in walk if p not in skip][:n]
    return chosen + [p for p in walk if p in skip][: n - len(chosen)]


def replay_batches(cfg: Any, ctx: StageContext, step: int, reward: RewardRef, batches: list[str]) -> list[str]:
    """Earlier batches of the run to train on beside `batches` (`cfg.replay`; none when it is off or the step's
    own groups carry enough signal): the newest with signal first, at most `max_age` steps back."""
    from stages.update.data import informative_groups

    replay = cfg.replay
    if not replay.enabled:
        return []
    wanted = replay.min_groups or cfg.rollout.prompts_per_step
    have = informative_groups(ctx.ws, batches, reward)
    out: list[str] = []
    for _, batch in reversed(past_batches(ctx.ws, ctx.run_name, before=step, after=step - replay.max_age - 1)):
        if have >= wanted:
            break
        found = informative_groups(ctx.ws, [batch], reward)
        if found:
            out.append(batch)
            have += found
    return out


def fork_point(ws: Workspace, spec: str) -> tuple[str, int]:
    """(checkpoint id, its step) where `rlops run --from SPEC` starts: `RUN@STEP` (the checkpoint RUN's step STEP
    made), `RUN@latest`, or a checkpoint id. KeyError naming what exists when there is no such checkpoint."""
    run, sep, at = spec.rpartition("@")
    if not sep:
        checkpoint = ws.catalog.get_checkpoint(spec)
        if checkpoint is None:
            raise KeyError(f"--from {spec}: no such checkpoint (give a checkpoint id, RUN@STEP or RUN@latest)")
        return spec, int(checkpoint["step"])
    lineage = [c for c in ws.catalog.checkpoints(run) if c["kind"] not in ("base",)]
    if not lineage:
        raise KeyError(f"--from {spec}: run {run!r} has no checkpoints in this workspace")
    if at == "latest":
        return lineage[-1]["policy_id"], int(lineage[-1]["step"])
    found = [c for c in lineage if str(c["step"]) == at]
    if not found:
        raise KeyError(f"--from {spec}: run {run!r} has no checkpoint at step {at} "
                       f"(steps: {sorted({int(c['step']) for c in lineage})})")
    return found[-1]["policy_id"], int(found[-1]["step"])


def check_fork(workspace: Any, spec: str | None) -> None:
    """Nothing for no `spec`; else `fork_point`'s KeyError when the workspace has no such checkpoint."""
    if spec:
        fork_point(Workspace.open(workspace), spec)


def fork_record(spec: str, policy: str, step: int) -> dict[str, Any]:
    """What a forked run records of its origin (the `runs` row's config, MLflow tags)."""
    return {"forked_from": spec, "fork_policy": policy, "fork_step": step}
