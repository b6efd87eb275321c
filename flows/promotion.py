"""Champion and challenger: a run's final checkpoint becomes a version of an MLflow registered model, is gated
against the serving champion, and every decision is recorded.

    decision = gate(cfg, ctx, final, call)                    # the end of a gated run (flows/prefect_flows.py)
    decision = gate(cfg, ctx, final, call, baseline="base-...")  # a judge gate's first night: against what served
    decision = promote(ws, "nightly", "ck-...", reason="...")  # `rlops promote`: a person's choice
    decision = rollback(ws, "nightly", reason="...")           # `rlops rollback`: the previous champion back

The registered model is `promote.model_name` (default: the run's name); each version carries its checkpoint's
lineage as tags (flows.mlflow_log.lineage_tags). The final checkpoint gets the alias `challenger`; it gets
`champion` when it is the model's first version, or when the gate's rule (stages/promote.py) says so after
both were evaluated on the same held-out prompts. Serving follows `champion` (stages/service/resolve.py).
With `promote.judge` the gate needs no labels: both answer the held-out prompts greedily and a pairwise judge
compares the answers (stages/judge_gate.py); its first version, when the run started from a `baseline` that
served before (the base model, say), must beat that baseline the same way instead of winning by default.

Every decision is a row of the catalog's `promotions` table (`rlops sql "SELECT * FROM promotions"`) and tags
and metrics on an MLflow run: the pipeline's parent run for the gate, a run `promotion:NAME` for a person's.
The row is written before the alias moves, and a rerun finds its decision: a run killed in between moves the
alias when it is resumed. Only drivers call these (a run's, or the `rlops promote`/`rollback` process).
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from flows.mlflow_log import MAX_TAG, lineage, lineage_tags, log_models, logged_model_id
from flows.pipeline import Call, direct
from stages import evaluate, judge_gate
from stages.promote import decide, decide_by_judge, gate_eval, rule
from storage.registry import Registry, Version
from storage.schema import now

if TYPE_CHECKING:
    from collections.abc import Callable

    from flows.run_config import RunConfig
    from stages.common import StageContext
    from storage.workspace import Workspace

CHAMPION, CHALLENGER = "champion", "challenger"


def register(ws: Workspace, name: str, policy_id: str, run_id: str, run_name: str) -> str:
    """The version of `name` that holds `policy_id`; a new one (lineage tags, the adapter logged as an MLflow
    model first where it is not yet, output by `run_id`) when there is none."""
    registry = Registry(ws.tracker.client)
    found = registry.version_of(name, policy_id)
    if found is not None:
        return found
    model_id = logged_model_id(ws, policy_id) or log_models(ws, run_id, run_name, [policy_id])[0]
    model = ws.tracker.client.get_logged_model(model_id)
    return registry.register(name, policy_id=policy_id, source=model.artifact_location, run_id=run_id,
                             model_id=model_id, tags=lineage_tags(run_name, lineage(ws, policy_id)))


def gate(cfg: RunConfig, ctx: StageContext, final: str, call: Call = direct, *,
         baseline: str | None = None) -> dict[str, Any] | None:
    """Register the run's final checkpoint as the `challenger` and decide whether it becomes the `champion`
    (the module docstring); returns the decision's row, or None when there is nothing to decide (the final
    policy is the base model, or already the champion). `ctx.parent_run_id` is the run's MLflow parent run:
    the version's source run, and where the decision is logged. `baseline`: the policy the run started from and
    that served until now (a checkpoint or the base model, which is never registered); with a judge gate and no
    champion yet, the challenger is compared with it (action `gate`, champion = the baseline, no version) and
    becomes the first champion only if it wins. Without it, or with a labelled gate, the first version wins."""
    ws, config = ctx.ws, cfg.gate_config
    name = config.model_name or cfg.name
    if ws.catalog.get_checkpoint(final)["kind"] == "base":
        return None
    registry = Registry(ws.tracker.client)
    version = register(ws, name, final, ctx.parent_run_id, cfg.name)
    registry.set_alias(name, CHALLENGER, version)
    champion = champion_of(registry, name)
    if champion is not None and champion.policy_id == final:
        return None
    judged = config.judge is not None
    against = champion.policy_id if champion else (baseline if judged and baseline not in (None, final) else None)
    base = {"model_name": name, "challenger": final, "challenger_version": version, "rule": rule(config),
            "metric": "judge_win_rate" if judged else config.metric, "run_name": cfg.name,
            "mlflow_run_id": ctx.parent_run_id}
    if (done := _decided(ws, name, against, final)) is not None:
        row = done  # decided before this process was stopped: only the alias may be left to move
    elif against is None:
        row = record(ws, base | {"action": "first", "promoted": True,
                                 "reason": f"the first version of {name}: no champion to beat"})
    elif judged:
        row = record(ws, base | {"action": "gate", "champion": against,
                                 "champion_version": champion.version if champion else None,
                                 **_judged(cfg, ctx, against, final, call)})
    else:
        evaluation = gate_eval(cfg.eval, config)
        evals = [call(f"gate-evaluate-{p}", evaluate.run, evaluation, ctx, policy_id=p, task=cfg.task,
                      rollout_config=cfg.rollout, score_config=cfg.score).id for p in (champion.policy_id, final)]
        metas = [ws.catalog.get_artifact(e)["meta"] for e in evals]
        c = evaluate.paired(ws, metas[0], metas[1], statistic=config.metric, resamples=config.resamples,
                            level=config.level)
        promoted, reason = decide(c, config)
        row = record(ws, base | {"action": "gate", "promoted": promoted, "reason": reason, **_was(champion),
                                 "champion_value": c.accuracy_a, "challenger_value": c.accuracy_b,
                                 "difference": c.difference, "low": c.low, "high": c.high, "prompts": c.prompts,
                                 "champion_eval": evals[0], "challenger_eval": evals[1]})
    if row["promoted"]:
        registry.set_alias(name, CHAMPION, version)
    return row


def _judged(cfg: RunConfig, ctx: StageContext, champion: str, challenger: str, call: Call) -> dict[str, Any]:
    """The judge gate's comparison of `challenger` with `champion` (the champion, or the baseline): their greedy
    answers, the judge's verdicts (stages/judge_gate.py) and the decision, as the fields of a promotions row."""
    config = cfg.gate_config
    answers = [call(f"gate-answer-{p}", judge_gate.answer, ctx, policy_id=p, task=cfg.task,
                    rollout_config=cfg.rollout, eval_config=cfg.eval).id for p in (champion, challenger)]
    judging = judge_gate.JudgeGateConfig(judge=config.judge, level=config.level, resamples=config.resamples)
    verdicts = call("gate-judge", judge_gate.run, judging, ctx, champion_batch=answers[0],
                    challenger_batch=answers[1]).id
    m = judge_gate.outcome(ctx.ws, verdicts)
    promoted, reason = decide_by_judge(m, config)
    return {"promoted": promoted, "reason": reason, "prompts": m.prompts, "low": m.low, "high": m.high,
            "challenger_value": m.win_rate, "champion_value": None if m.win_rate is None else 1 - m.win_rate,
            "difference": None if m.win_rate is None else m.win_rate - config.min_win_rate,
            "champion_eval": answers[0], "challenger_eval": answers[1], "judge_version": m.judge_version,
            "verdicts": verdicts}


def promote(ws: Workspace, name: str, policy_id: str, reason: str) -> dict[str, Any]:
    """Make `policy_id` the champion of `name` by a person's decision (registering it first if it is not a
    version yet); the previous champion stays in the history `rollback` returns to."""
    registry = Registry(ws.tracker.client)
    champion = champion_of(registry, name)
    if champion is not None and champion.policy_id == policy_id:
        raise ValueError(f"{policy_id} is already the champion of {name} (version {champion.version})")
    ckpt = ws.catalog.get_checkpoint(policy_id)
    return _move_champion(ws, registry, name, champion, "manual", policy_id, reason,
                          lambda run_id: register(ws, name, policy_id, run_id, ckpt["run_name"] or name))


def rollback(ws: Workspace, name: str, reason: str) -> dict[str, Any]:
    """Give `name`'s champion alias back to the champion before the current one (`history`)."""
    registry = Registry(ws.tracker.client)
    champion = champion_of(registry, name)
    stack = history(ws.catalog.promotions(name))
    if len(stack) < 2:
        raise KeyError(f"{name} has no previous champion to roll back to ({len(stack)} champion in its promotions)")
    back_policy, back_version = stack[-2]
    return _move_champion(ws, registry, name, champion, "rollback", back_policy, reason, lambda run_id: back_version)


def _move_champion(ws: Workspace, registry: Registry, name: str, champion: Version | None, action: str,
                   policy_id: str, reason: str, version_of: Callable[[str], str]) -> dict[str, Any]:
    """A person's move of the champion alias (`action`: manual or rollback) to `policy_id`, whose version
    `version_of(mlflow run id)` gives: recorded as a promotion row and an MLflow run, then the alias set."""
    run_id = ws.tracker.start_run(f"promotion:{name}", tags={"rlops.promotion.model": name})
    version = version_of(run_id)
    command = {"manual": "rlops promote", "rollback": "rlops rollback"}[action]
    row = record(ws, {"model_name": name, "action": action, "promoted": True, "reason": reason,
                      "challenger": policy_id, "challenger_version": version, "rule": f"manual: {command}",
                      "mlflow_run_id": run_id, **_was(champion)})
    registry.set_alias(name, CHAMPION, version)
    ws.tracker.end_run(run_id)
    return row


def history(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The champions of a model as a stack of (policy id, version), from its promotions oldest first: each
    promotion pushes the new champion, each rollback pops the current one. Its top is the champion."""
    stack: list[tuple[str, str]] = []
    for r in rows:
        if r["promoted"] and r["action"] == "rollback":
            stack.pop()
        elif r["promoted"]:
            stack.append((r["challenger"], r["challenger_version"]))
    return stack


def champion_of(registry: Registry, name: str) -> Version | None:
    """The version the alias `champion` names, or None (none yet; KeyError for an unknown model is the caller's
    to give: a gated run creates the model first)."""
    if not registry.exists(name):
        raise KeyError(f"no registered model {name!r} in this workspace (see `rlops sql \"SELECT DISTINCT model_name "
                       "FROM promotions\"`)")
    try:
        return registry.get(name, alias=CHAMPION)
    except KeyError:
        return None


def record(ws: Workspace, row: dict[str, Any]) -> dict[str, Any]:
    """Write a decision to the catalog's `promotions` and onto its MLflow run (tags, and metrics for a gate's
    comparison); returns the row as written."""
    row = {**row, "promotion_id": f"pr-{uuid.uuid4().hex[:16]}", "decided_at": now()}
    ws.catalog.add_promotion(row)
    tags = {f"rlops.promotion.{k}": str(row[k])[:MAX_TAG] for k in
            ("promotion_id", "model_name", "action", "promoted", "reason", "rule", "champion", "champion_version",
             "challenger", "challenger_version", "judge_version", "verdicts") if row.get(k) is not None}
    ws.tracker.set_tags(row["mlflow_run_id"], tags)
    ws.tracker.log_metrics(row["mlflow_run_id"], {f"promotion/{k}": row[k] for k in
                                                  ("champion_value", "challenger_value", "difference", "low", "high")
                                                  if row.get(k) is not None})
    return row


def _was(champion: Version | None) -> dict[str, Any]:
    return {"champion": champion.policy_id, "champion_version": champion.version} if champion else {}


def _decided(ws: Workspace, name: str, champion: str | None, challenger: str) -> dict[str, Any] | None:
    """The gate's earlier decision on this champion (or baseline; None: there was none, the first version) and
    challenger."""
    return next((r for r in ws.catalog.promotions(name) if r["action"] in ("gate", "first")
                 and r["champion"] == champion and r["challenger"] == challenger), None)
