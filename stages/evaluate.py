"""Evaluation stage: a checkpoint on a task's held-out split -> eval rollouts + metric rows.

Evaluation is composed from the other stages, so eval episodes are audited like training ones:
a rollout batch on the eval split (greedy by default, or `samples` per prompt), scored with the
run's rewards, then aggregated into `evals` rows:

  accuracy          fraction of episodes whose metric reward >= success_threshold
  reward_mean       mean metric reward (null rewards count as 0)
  pass@k            (samples > 1) fraction of prompts with at least one success among k samples
  mean_turns        assistant turns per episode
  tool_calls        tool calls per episode
  tool_call_validity fraction of tool calls that did not produce an error message (when any)
  answer_rate       fraction of episodes that ended with an answer
  out_of_turns      fraction of episodes whose last allowed turn still called a tool

`compare` sets two policies' latest evaluations side by side, prompt by prompt, with a bootstrap interval
on the accuracy difference (`rlops eval compare`); `paired` does it for any two evaluations and per-prompt
statistic (the promotion gate, flows/promotion.py).
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from stages import rollout as rollout_stage
from stages import score as score_stage
from stages.common import ArtifactRef, Operational, StageContext, run_stage
from stages.reward_ref import RewardRef
from storage.schema import EvalRow, to_table

if TYPE_CHECKING:
    from storage.workspace import Workspace


class EvalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    split: str = "test"  # held-out prompts, never trained on
    n_prompts: int | None = Field(100, ge=1)  # None = the whole split; 100 matches the reference measurement
    samples: int = Field(1, ge=1)  # per prompt; >1 adds pass@k
    temperature: float = Field(0.0, ge=0.0)  # greedy: a stable number to compare checkpoints by
    metric: str | None = None  # reward name behind accuracy; None = the score config's total
    success_threshold: float = 1.0  # an episode "succeeds" when the metric reward reaches this
    # Tokens one generate call may hold, each episode counted at the rollout's max_total_tokens (`groups_per_call`).
    # Decoding on a CPU reads every weight once per step whatever the batch, so one call of the parity config's 100
    # short prompts takes 10.9 s where calls of 32 took 20.2 s (docs/BENCHMARKS.md); long agent episodes keep calls
    # of 32. What is generated does not depend on it.
    batch_tokens: int = Operational(32768, ge=1)


def run(config: EvalConfig, ctx: StageContext, policy_id: str, task: rollout_stage.TaskSpec,
        rollout_config: rollout_stage.RolloutConfig, score_config: score_stage.ScoreConfig) -> ArtifactRef:
    """Evaluate `policy_id`; returns the evals artifact (its rows are in the `evals` view)."""
    roll_cfg = episodes_config(config, rollout_config, task)
    n = roll_cfg.prompts_per_step
    batch = rollout_stage.run(roll_cfg, ctx, policy_id, task, split=config.split, step=0)
    score_config = score_stage.in_workspace(score_config, ctx.ws)  # the version scored is the one read below
    scored = score_stage.run(score_config, ctx, [batch.id])
    metric = RewardRef.configured(score_config, score_config.default_reward(config.metric))

    def body(eval_id: str, mlflow_run_id: str) -> dict[str, float]:
        metrics = _metrics(ctx, batch.id, metric, config)
        rows = [EvalRow(policy_id, task.name, config.split, m, v, n * config.samples, eval_id) for m, v in metrics.items()]
        ctx.ws.write_part("evals", eval_id, to_table(rows, EvalRow), part="part-00000")
        return metrics

    return run_stage(ctx, "evaluate", "evals", [policy_id, batch.id, scored.id],
                     {"eval": config, "metric": str(metric)}, body,
                     meta={"policy_id": policy_id, "split": config.split, "metric": str(metric),
                           "success_threshold": config.success_threshold, "rollouts": batch.id})


def episodes_config(config: EvalConfig, rollout_config: rollout_stage.RolloutConfig,
                    task: rollout_stage.TaskSpec) -> rollout_stage.RolloutConfig:
    """The rollout config of an evaluation's episodes (run on `config.split` at step 0): the split's first
    `n_prompts` prompts (all of them when it has fewer), `samples` each at `temperature`. The one home of which
    held-out episodes an evaluation makes; the label-free gate's answers are its greedy single samples
    (stages/judge_gate.py), so the two share a rollout batch where the settings agree."""
    available = len(_task_prompts(task, config.split))
    n = min(config.n_prompts or available, available)
    return rollout_config.model_copy(update={"temperature": config.temperature, "group_size": config.samples,
                                             "prompts_per_step": n,
                                             "groups_per_shard": groups_per_call(config, rollout_config)})


def groups_per_call(config: EvalConfig, rollout_config: rollout_stage.RolloutConfig) -> int:
    """Prompts (groups of `config.samples` episodes) an evaluation generates per call: as many as `batch_tokens` holds
    at the rollout's max_total_tokens per episode, at least 32 episodes' worth (eval groups are small, often one
    greedy sample), and never fewer than the rollout's own shards."""
    episodes = max(32, config.batch_tokens // rollout_config.max_total_tokens)
    return max(rollout_config.groups_per_shard, episodes // config.samples, 1)


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
        "tool_calls": sum(r["num_tool_calls"] for r in rows) / n,
        "out_of_turns": sum(r["finish_reason"] == "max_turns" for r in rows) / n,
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


# The per-prompt statistics a paired comparison can take (`paired`): each prompt's success rate, its mean
# metric reward, and whether any of its samples succeeded (pass@k, k = the evaluation's samples).
PAIRED_STATISTICS = ("accuracy", "reward_mean", "pass@k")


@dataclass
class Comparison:
    """Policy b against policy a on the prompts both evaluations share (`paired`)."""

    policy_a: str
    policy_b: str
    metric: str  # the reward behind the statistic, name@version
    prompts: int  # prompts evaluated for both
    accuracy_a: float  # mean over those prompts of the statistic (named for the default, accuracy)
    accuracy_b: float
    low: float  # bootstrap interval (95 % unless asked) of accuracy_b - accuracy_a, resampling prompts
    high: float
    statistic: str = "accuracy"  # what was compared per prompt: accuracy, reward_mean or pass@k

    @property
    def difference(self) -> float:
        return self.accuracy_b - self.accuracy_a


def compare(ws: Workspace, policy_a: str, policy_b: str, split: str | None = None, resamples: int = 10_000,
            seed: int = 0) -> Comparison:
    """Compare the accuracy of the latest complete evaluations of two policies (on `split`, default: any)
    prompt by prompt (`paired`)."""
    return paired(ws, latest_eval(ws, policy_a, split), latest_eval(ws, policy_b, split), resamples=resamples,
                  seed=seed)


def paired(ws: Workspace, eval_a: dict, eval_b: dict, statistic: str = "accuracy", resamples: int = 10_000,
           seed: int = 0, level: float = 0.95) -> Comparison:
    """Compare two evaluations (their artifacts' `meta`) prompt by prompt: the one home of the paired bootstrap,
    for `rlops eval compare` and the promotion gate.

    Each prompt's statistic (PAIRED_STATISTICS; the success rate by default: the share of its samples whose
    metric reward reaches the threshold) is paired across the two evaluations, and the interval is a percentile
    bootstrap over prompts: it covers the question-to-question spread, which a difference of two accuracies
    measured on the same few dozen questions must be judged against. Both evaluations must use the same reward
    and threshold, or the comparison is refused."""
    a_id, b_id = eval_a["policy_id"], eval_b["policy_id"]
    if (eval_a["metric"], eval_a["success_threshold"]) != (eval_b["metric"], eval_b["success_threshold"]):
        raise ValueError(f"the evaluations of {a_id} and {b_id} use different metrics "
                         f"({eval_a['metric']} >= {eval_a['success_threshold']} vs "
                         f"{eval_b['metric']} >= {eval_b['success_threshold']}): nothing to pair")
    column = "pass" if statistic.startswith("pass@") else statistic
    values = [{p: row[column] for p, row in by_prompt(ws, e).items()} for e in (eval_a, eval_b)]
    shared = sorted(set(values[0]) & set(values[1]))
    if not shared:
        raise ValueError(f"the evaluations of {a_id} and {b_id} share no prompt")
    a, b = [values[0][p] for p in shared], [values[1][p] for p in shared]
    low, high = bootstrap_interval([y - x for x, y in zip(a, b)], resamples, seed, level)
    n = len(shared)
    return Comparison(a_id, b_id, eval_a["metric"], n, sum(a) / n, sum(b) / n, low, high, statistic)


def bootstrap_interval(values: list[float], resamples: int = 10_000, seed: int = 0,
                       level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values`: resample them with replacement `resamples`
    times (seeded) and take the central `level` of the resampled means."""
    rng, n = random.Random(seed), len(values)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    tail = (1 - level) / 2
    return means[int(tail * resamples)], means[min(resamples - 1, int((1 - tail) * resamples))]


def latest_eval(ws: Workspace, policy_id: str, split: str | None) -> dict:
    """The newest complete evals artifact of `policy_id` that records its rollouts and metric (meta)."""
    rows = ws.query(
        "SELECT meta FROM artifacts WHERE kind = 'evals' AND status = 'complete' "
        "AND json_extract_string(meta, '$.policy_id') = $policy "
        "AND json_extract_string(meta, '$.rollouts') IS NOT NULL "
        "AND ($split IS NULL OR json_extract_string(meta, '$.split') = $split) "
        "ORDER BY completed_at DESC LIMIT 1", {"policy": policy_id, "split": split}).to_pylist()
    if not rows:
        raise ValueError(f"no evaluation of {policy_id}" + (f" on {split!r}" if split else "") +
                         " that records its rollouts (evaluations made before this was recorded need a rerun)")
    return json.loads(rows[0]["meta"])


def success_by_prompt(ws: Workspace, meta: dict) -> dict[str, float]:
    """prompt_id -> the share of its eval samples that succeeded (a missing reward counts as a failure)."""
    return {p: row["accuracy"] for p, row in by_prompt(ws, meta).items()}


def by_prompt(ws: Workspace, meta: dict) -> dict[str, dict[str, float]]:
    """prompt_id -> its statistics in an evaluation: `accuracy` (the share of its samples that succeeded),
    `pass` (1.0 when any did) and `reward_mean` (the mean metric reward); a missing reward counts as 0."""
    metric = RewardRef.parse(meta["metric"])
    success = "CASE WHEN coalesce(w.value, 0) >= $threshold - 1e-9 THEN 1.0 ELSE 0.0 END"
    rows = ws.query(
        f"SELECT r.prompt_id, avg({success}) AS accuracy, max({success}) AS pass, "
        "avg(coalesce(w.value, 0)) AS reward_mean FROM rollouts r LEFT JOIN rewards w ON w.rollout_id = r.rollout_id "
        "AND w.reward_name = $name AND w.reward_version = $version WHERE r.batch_id = $batch GROUP BY r.prompt_id",
        {"threshold": meta["success_threshold"], "name": metric.name, "version": metric.version,
         "batch": meta["rollouts"]}).to_pylist()
    return {r.pop("prompt_id"): r for r in rows}
