"""The training pipeline: optional SFT warm-start, then for each step rollout -> score -> GRPO,
evaluating at the start, every `eval.every` steps and at the end.

`train` is plain Python over the stage functions; `call` decides how each stage call runs:
directly (`direct`, used by tests and benchmarks) or as a Prefect task (`flows.prefect_flows`).
Every stage is idempotent by artifact id, so rerunning `train` after a crash recomputes nothing
that was complete and continues from the first missing artifact; that needs no orchestrator
state, and survives a lost Prefect database.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from flows import async_steps
from flows.algorithms import update_stage, update_workers
from flows.run_config import RunConfig
from flows.step_data import curriculum_prompts, replay_batches
from stages import cluster, evaluate, rollout, score, sft
from stages.common import ArtifactRef, StageContext, base_policy
from stages.policy.session import PolicySession
from stages.reward_ref import RewardRef
from storage.workspace import Workspace

Call = Callable[..., ArtifactRef]
# What the per-step summary shows of the GRPO stage's metrics (besides the step's reward mean).
STEP_FIELDS = ("loss", "frac_zero_variance_groups", "clip_frac", "staleness", "is_weight_mean", "is_masked_frac")


def direct(name: str, fn: Callable[..., ArtifactRef], *args: Any, **kwargs: Any) -> ArtifactRef:
    return fn(*args, **kwargs)


@dataclass
class TrainResult:
    run_name: str
    base: str
    sft: str | None
    final: str
    policies: list[str] = field(default_factory=list)  # every GRPO checkpoint, in order
    evals: dict[str, dict[str, float]] = field(default_factory=dict)  # policy_id -> metrics
    batches: list[str] = field(default_factory=list)  # rollout batches, in step order


def sft_data(cfg: RunConfig, ws_root: Path) -> str:
    """The SFT data file: the configured path, or the task's oracle demonstrations written into the workspace."""
    assert cfg.sft is not None
    if cfg.sft.data != "oracle":
        return cfg.sft.data
    import importlib

    module = importlib.import_module(cfg.task.name if "." in cfg.task.name else f"tasks.{cfg.task.name}")
    if not hasattr(module, "write_oracle_dataset"):
        raise ValueError(f"task {cfg.task.name!r} has no write_oracle_dataset: give sft.data a file")
    path = ws_root / "sft" / f"{cfg.task.name}-oracle.jsonl"
    # Written whole or not at all (tasks.base.write_chat_jsonl): its hash is part of the SFT checkpoint id.
    module.write_oracle_dataset(path, split="train", **cfg.task.params)
    return str(path)


def evaluate_policy(cfg: RunConfig, ctx: StageContext, policy: str, call: Call = direct) -> dict[str, float]:
    ref = call(f"evaluate-{policy}", evaluate.run, cfg.eval, ctx, policy_id=policy, task=cfg.task,
               rollout_config=cfg.rollout, score_config=cfg.score)
    meta = ctx.ws.catalog.get_artifact(ref.id)["meta"]
    return meta["metrics"]


def _print_step(row: dict[str, Any]) -> None:
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), file=sys.stderr)


@contextmanager
def resident(ctx: StageContext, enabled: bool = True) -> Iterator[StageContext]:
    """`ctx` with a resident policy (stages/policy/session.py) for the block: the models the stages load stay
    in memory between stage calls and are released at the end. `enabled=False`, or a context that
    already has a session, gives `ctx` unchanged."""
    if not enabled or ctx.session is not None:
        yield ctx
        return
    with PolicySession() as session:
        yield replace(ctx, session=session)


def train(cfg: RunConfig, ctx: StageContext, call: Call = direct, start_policy: str | None = None,
          start_step: int = 0, on_step: Callable[[dict[str, Any]], None] = _print_step,
          keep_resident: bool = True, fork: bool = False) -> TrainResult:
    """Run (or resume) the pipeline; returns the lineage and the eval metrics per evaluated policy.

    `start_policy`/`start_step` continue an existing lineage (scheduled runs) instead of starting
    from the base model (and skip the warm-start); a continued lineage trains on the prompts it has not
    seen first. `fork`: the run starts a new lineage at `start_policy` (`rlops run --from`, any
    checkpoint of any run) and draws each step's prompts as the run it forks would have, so that only
    what the config changes differs from the parent's continuation. `on_step` receives one summary row per step and
    per evaluation (Prefect flows turn them into artifacts). `keep_resident` keeps one policy in
    memory for the whole run (`resident`); off, every stage loads its model from files, as
    `rlops stage` does. Artifact ids and results are the same either way.
    """
    with resident(ctx, keep_resident) as ctx:
        return _train(cfg, ctx, call, start_policy, start_step, on_step, fork)


def ray_workers(cfg: RunConfig) -> dict[str, int]:
    """What each stage of the run asks of Ray (stages.cluster.prepare checks it before any work)."""
    return {"rollout.workers": cfg.rollout.workers, "score.workers": cfg.score.workers,
            "grpo.workers": update_workers(cfg)}


def prepare_cluster(cfg: RunConfig) -> None:
    """Join or start the run's Ray and refuse what it can never place (stages.cluster.prepare); a no-op for a
    run that asks no stage for Ray workers. `rlops run` calls it before its temporary Prefect server starts,
    the run itself again (then Ray is ready)."""
    cluster.prepare(cfg.ray, ray_workers(cfg), overlapped=cfg.max_staleness > 0)


def _train(cfg: RunConfig, ctx: StageContext, call: Call, start_policy: str | None, start_step: int,
           on_step: Callable[[dict[str, Any]], None], fork: bool = False) -> TrainResult:
    ws = ctx.ws
    cfg = with_workspace_context(cfg, ws)
    cluster.prepare(ctx.ray, ray_workers(cfg), overlapped=cfg.max_staleness > 0)
    teacher = cfg.grpo.distill.teacher if cfg.grpo.distill else None
    if teacher and teacher.startswith("ck-") and ws.catalog.get_checkpoint(teacher) is None:
        raise KeyError(f"grpo.distill.teacher: no checkpoint {teacher} in this workspace")  # before any compute
    base = base_policy(ws, cfg.base_model)
    policy, sft_policy = start_policy or base, None
    if cfg.sft is not None and start_policy is None:
        sft_policy = call("sft", sft.run, cfg.sft, ctx, base_model=cfg.base_model, data=sft_data(cfg, ws.root)).id
        policy = sft_policy
    result = TrainResult(cfg.name, base, sft_policy, policy)
    reward = RewardRef.configured(cfg.score, cfg.reward_name)  # what each step's score stage writes
    if start_policy is None:
        for p in [base] + ([sft_policy] if sft_policy else []):
            result.evals[p] = evaluate_policy(cfg, ctx, p, call)
            on_step({"eval": p, **result.evals[p]})

    def generate(step: int, gen_policy: str) -> tuple[str, list[str], str, int]:
        # A continued lineage (a scheduled run) trains on prompts it has not seen first: rows added to
        # the task's data since the last run are picked up at once.
        # The curriculum (flows/step_data.py) chooses from the past pass rates instead.
        fresh = unseen_prompts(cfg, gen_ctx, cfg.rollout.prompts_per_step) if start_policy and not fork else None
        fresh = curriculum_prompts(cfg, gen_ctx, step, reward) or fresh
        batch = call(f"rollout-{step}", rollout.run, cfg.rollout, gen_ctx, policy_id=gen_policy, task=cfg.task,
                     split="train", step=step, prompt_ids=fresh)
        scored = call(f"score-{step}", score.run, cfg.score, gen_ctx, batches=[batch.id])
        batches = [batch.id]
        if cfg.dynamic_sampling.enabled:
            batches += more_batches(cfg, gen_ctx, call, gen_policy, step, reward, batch.id)
        replayed = replay_batches(cfg, gen_ctx, step, reward, batches)
        return batch.id, batches + replayed, scored.id, len(replayed)

    update_fn, update_config = update_stage(cfg)  # the `algorithm:` (grpo unless set)
    if cfg.max_staleness and "sleep_generation" in type(update_config).model_fields:
        # an asynchronous run's vLLM engine keeps generating while the update runs (operational: same ids)
        update_config = update_config.model_copy(update={"sleep_generation": False})

    def update(step: int, policy: str, generated: tuple[str, list[str], str, int]) -> str:
        batch, batches, scored, replayed = generated
        policy = call(f"{cfg.algorithm}-{step}", update_fn, update_config, ctx, parent_policy=policy, batches=batches,
                      reward=reward).id
        result.batches.extend(batches[:len(batches) - replayed])  # its own batches; the replayed ones are earlier steps'
        result.policies.append(policy)
        metrics = ws.catalog.get_artifact(scored)["meta"]["metrics"]
        trained = ws.catalog.get_artifact(policy)["meta"]["metrics"]
        on_step({"step": step, "batch": batch, "policy": policy,
                 "reward_mean": metrics.get(f"{reward.name}.mean", float("nan")),
                 **({"batches": len(batches) - replayed} if cfg.dynamic_sampling.enabled else {}),
                 **({"replayed_batches": replayed} if cfg.replay.enabled else {}),
                 **{k: trained[k] for k in STEP_FIELDS if k in trained},
                 **({"entropy": trained["entropy"]} if "entropy" in trained else {})})  # none on a step without samples
        last = step == start_step + cfg.steps - 1
        if (step - start_step + 1) % cfg.eval.every == 0 or last:
            result.evals[policy] = evaluate_policy(cfg, ctx, policy, call)
            on_step({"eval": policy, **result.evals[policy]})
        return policy

    # max_staleness K: the batch of step s comes from the policy K versions back (flows/async_steps.py);
    # K = 0 makes the calls of the synchronous loop, in its order.
    with async_steps.generation_context(ctx, cfg.max_staleness, cfg.base_model) as gen_ctx:
        lineage = async_steps.pipelined(range(start_step, start_step + cfg.steps), cfg.max_staleness, policy,
                                        generate, update)
    policy = lineage[-1] if lineage else policy
    result.final = policy
    return result


def more_batches(cfg: RunConfig, ctx: StageContext, call: Call, policy: str, step: int, reward: RewardRef,
                 first: str) -> list[str]:
    """Dynamic sampling (`cfg.dynamic_sampling`): extra scored rollout batches of `step` on other train
    prompts until the step's batches hold `min_groups` informative groups (rewards not all equal) or
    `max_batches` batches exist. Deterministic: extra batch k draws its prompts by a shuffle seeded with
    the rollout seed, the step and k, so a rerun makes (finds) the same batches."""
    import random

    from stages.update.data import informative_groups
    from tasks.base import load_task

    ds, n = cfg.dynamic_sampling, cfg.rollout.prompts_per_step
    wanted = ds.min_groups or n
    prompts = [p.prompt_id for p in load_task(cfg.task.name, cfg.task.params).prompts("train")]
    batches: list[str] = []
    for k in range(1, ds.max_batches):
        if informative_groups(ctx.ws, [first, *batches], reward) >= wanted:
            break
        drawn = random.Random(f"dynamic-sampling:{cfg.rollout.seed}:{step}:{k}").sample(prompts, min(n, len(prompts)))
        extra = call(f"rollout-{step}-more{k}", rollout.run, cfg.rollout, ctx, policy_id=policy, task=cfg.task,
                     split="train", step=step, prompt_ids=drawn)
        call(f"score-{step}-more{k}", score.run, cfg.score, ctx, batches=[extra.id])
        batches.append(extra.id)
    return batches


def lineage_end(ws: Workspace, run_name: str) -> tuple[str | None, int]:
    """(policy id, step) of the run's newest update checkpoint, where a scheduled run continues its lineage;
    (None, 0) for a run with none (it starts from the base model, or its SFT warm-start)."""
    # every update's checkpoint continues a lineage, whatever its algorithm (grpo, dpo, ...)
    latest = [c for c in ws.catalog.checkpoints(run_name) if c["kind"] not in ("base", "sft")]
    return (latest[-1]["policy_id"], int(latest[-1]["step"])) if latest else (None, 0)


def unseen_prompts(cfg: RunConfig, ctx: StageContext, n: int) -> list[str] | None:
    """The first `n` train prompts (in task order) that no training batch of this run has used, or None
    when fewer than `n` are left (the step then cycles through the split as usual)."""
    from tasks.base import load_task

    used = {r["prompt_id"] for r in ctx.ws.query(
        "SELECT DISTINCT r.prompt_id FROM rollouts r JOIN stage_runs s ON s.artifact_id = r.batch_id "
        "WHERE s.stage = 'rollout' AND s.run_name = ? AND r.split = 'train'", [ctx.run_name]).to_pylist()}
    unseen = [p.prompt_id for p in load_task(cfg.task.name, cfg.task.params).prompts("train") if p.prompt_id not in used]
    return unseen[:n] if len(unseen) >= n else None


def with_workspace_context(cfg: RunConfig, ws: Any) -> RunConfig:
    """`cfg` with its rewards' workspace context filled in once (`score.in_workspace`: the judge's cache, people's
    labels), so every stage call of a run sees the same labels, and the version each step writes is the one its
    update trains on, even while someone keeps labelling. The stored run config stays the unfilled one."""
    return cfg.model_copy(update={"score": score.in_workspace(cfg.score, ws)})


def rescore(cfg: RunConfig, ctx: StageContext, run_name: str, call: Call = direct) -> list[ArtifactRef]:
    """Score every stored training rollout batch of `run_name` with the config's (edited) rewards."""
    cfg = with_workspace_context(cfg, ctx.ws)  # one version of a label-reading reward over all the batches
    batches = run_batches(ctx, run_name)
    return [call(f"rescore-{i}", score.run, cfg.score, ctx, batches=[b]) for i, b in enumerate(batches)]


def retrain(cfg: RunConfig, ctx: StageContext, from_policy: str, run_name: str, call: Call = direct) -> list[str]:
    """Replay the GRPO updates of `run_name` from `from_policy` on its stored (rescored) rollouts:
    no generation; a new lineage branch trained on the config's current reward version."""
    policy, lineage = from_policy, []
    cfg = with_workspace_context(cfg, ctx.ws)
    reward = RewardRef.configured(cfg.score, cfg.reward_name)
    cluster.prepare(ctx.ray, ray_workers(cfg))
    with resident(ctx) as ctx:  # one model for every update of the replay
        for i, batches in enumerate(step_batches(ctx, run_name)):
            for batch in batches:  # a no-op when already rescored
                call(f"rescore-{i}", score.run, cfg.score, ctx, batches=[batch])
            update, update_config = update_stage(cfg)
            policy = call(f"retrain-{i}", update, update_config, ctx, parent_policy=policy, batches=batches,
                          reward=reward).id
            lineage.append(policy)
    return lineage


def run_batches(ctx: StageContext, run_name: str) -> list[str]:
    """The training rollout batches of a run, in step order."""
    return [b for batches in step_batches(ctx, run_name) for b in batches]


def step_batches(ctx: StageContext, run_name: str) -> list[list[str]]:
    """The training rollout batches of a run, grouped by step (several with dynamic sampling), in step order."""
    rows = ctx.ws.query(
        "SELECT a.artifact_id, CAST(a.meta->>'step' AS INTEGER) AS step FROM artifacts a "
        "JOIN stage_runs s ON s.artifact_id = a.artifact_id "
        "WHERE a.kind = 'rollouts' AND s.stage = 'rollout' AND s.run_name = ? AND a.meta->>'split' = 'train' "
        "GROUP BY a.artifact_id, a.meta ORDER BY CAST(a.meta->>'step' AS INTEGER), min(a.completed_at)", [run_name]
    ).to_pylist()
    if not rows:
        raise KeyError(f"run {run_name!r} has no training rollout batches in this workspace")
    steps: dict[int, list[str]] = {}
    for r in rows:
        steps.setdefault(r["step"], []).append(r["artifact_id"])
    return list(steps.values())
