"""Evaluation stage: a checkpoint on a task's held-out split -> eval rollouts + metric rows.

Evaluation is composed from the other stages, so eval episodes are audited like training ones:
a rollout batch on the eval split (greedy by default, or `samples` per prompt), scored with the
run's rewards, then aggregated into `evals` rows:

  accuracy          fraction of episodes whose metric reward >= success_threshold
  reward_mean       mean metric reward (null rewards count as 0)
  pass@k            (samples > 1) fraction of prompts with at least one success among k samples
  mean_turns        assistant turns per episode
  tool_call_validity fraction of tool calls that did not produce an error message (when any)
  answer_rate       fraction of episodes that ended with an answer
"""

from __future__ import annotations

from collections import defaultdict

from pydantic import BaseModel, ConfigDict, Field

from stages import rollout as rollout_stage
from stages import score as score_stage
from stages.common import ArtifactRef, StageContext, run_stage
from stages.reward_ref import RewardRef
from storage.schema import EvalRow, to_table


class EvalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    split: str = "test"  # held-out prompts, never trained on
    n_prompts: int | None = Field(100, ge=1)  # None = the whole split; 100 matches the reference measurement
    samples: int = Field(1, ge=1)  # per prompt; >1 adds pass@k
    temperature: float = Field(0.0, ge=0.0)  # greedy: a stable number to compare checkpoints by
    metric: str | None = None  # reward name behind accuracy; None = the score config's total
    success_threshold: float = 1.0  # an episode "succeeds" when the metric reward reaches this


def run(config: EvalConfig, ctx: StageContext, policy_id: str, task: rollout_stage.TaskSpec,
        rollout_config: rollout_stage.RolloutConfig, score_config: score_stage.ScoreConfig) -> ArtifactRef:
    """Evaluate `policy_id`; returns the evals artifact (its rows are in the `evals` view)."""
    available = len(_task_prompts(task, config.split))
    n = min(config.n_prompts or available, available)
    # Eval groups are small (often one greedy sample): batch ~32 episodes per generate call anyway.
    roll_cfg = rollout_config.model_copy(update={"temperature": config.temperature, "group_size": config.samples,
                                                 "prompts_per_step": n,
                                                 "groups_per_shard": max(rollout_config.groups_per_shard, 32 // config.samples)})
    batch = rollout_stage.run(roll_cfg, ctx, policy_id, task, split=config.split, step=0)
    scored = score_stage.run(score_config, ctx, [batch.id])
    metric = RewardRef.configured(score_config, score_config.default_reward(config.metric))

    def body(eval_id: str, mlflow_run_id: str) -> dict[str, float]:
        metrics = _metrics(ctx, batch.id, metric, config)
        rows = [EvalRow(policy_id, task.name, config.split, m, v, n * config.samples, eval_id) for m, v in metrics.items()]
        ctx.ws.write_part("evals", eval_id, to_table(rows, EvalRow), part="part-00000")
        return metrics

    return run_stage(ctx, "evaluate", "evals", [policy_id, batch.id, scored.id],
                     {"eval": config, "metric": str(metric)}, body,
                     meta={"policy_id": policy_id, "split": config.split})


def _task_prompts(task: rollout_stage.TaskSpec, split: str) -> list:
    from tasks.base import load_task

    return load_task(task.name, task.params).prompts(split)


def _metrics(ctx: StageContext, batch_id: str, metric: RewardRef, config: EvalConfig) -> dict[str, float]:
    rows = ctx.ws.query(
        "SELECT r.group_id, r.num_turns, r.num_tool_calls, r.finish_reason, "
        "  len(list_filter(r.messages, lambda m: m.role = 'tool' AND starts_with(coalesce(m.content, ''), 'error:'))) AS tool_errors, "
        "  w.value "
        "FROM rollouts r LEFT JOIN rewards w ON w.rollout_id = r.rollout_id AND w.reward_name = $name "
        "  AND w.reward_version = $version WHERE r.batch_id = $batch",
        {"name": metric.name, "version": metric.version, "batch": batch_id}).to_pylist()
    n = len(rows)
    success = [(r["value"] or 0.0) >= config.success_threshold - 1e-9 for r in rows]
    out = {
        "accuracy": sum(success) / n,
        "reward_mean": sum(r["value"] or 0.0 for r in rows) / n,
        "mean_turns": sum(r["num_turns"] for r in rows) / n,
        "answer_rate": sum(r["finish_reason"] == "answer" for r in rows) / n,
    }
    calls = sum(r["num_tool_calls"] for r in rows)
    if calls:
        out["tool_call_validity"] = 1.0 - sum(r["tool_errors"] for r in rows) / calls
    if config.samples > 1:
        by_group: dict[str, bool] = defaultdict(bool)
        for r, ok in zip(rows, success):
            by_group[r["group_id"]] |= ok
        out[f"pass@{config.samples}"] = sum(by_group.values()) / len(by_group)
    return out
