"""Score stage: rollout batches x a reward spec -> reward rows, one artifact per (batch, reward version).

Every (rollout batch, reward name, reward version) is its own `rewards` artifact with a
deterministic id, so:
  - rescoring with unchanged rewards finds every part in the catalog and computes nothing;
  - after editing one reward only that reward (and the weighted total, whose version follows its
    components) is computed; the total is summed from the stored component rows, not recomputed;
  - the `rewards` view holds each (rollout, reward name, version) exactly once.
The stage's own artifact (kind `reward_set`, prefix `rs-`) is the manifest tying them together:
its meta maps each reward name to its version and parts, and it is what `rlops stage score` prints.

Failures are data: a reward that raises or returns a bad value gives a null `value` with the reason
in `error`. If a reward's error fraction exceeds `max_error_fraction` the stage fails with a
summary before writing that reward's rows (nothing partial is ever visible).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field

from rewards.base import Outcome, RewardSpec, compute, fill_params, info, load_fn, reward_version, total_version, weighted_total
from stages.common import CODE_VERSION, ArtifactRef, StageContext, run_stage
from storage.ids import artifact_id, config_hash
from storage.schema import RewardRow, Rollout, from_table, now, to_table

TOKEN_COLUMNS = ("token_ids", "loss_mask", "behavior_logprobs")


class ScoreConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rewards: list[RewardSpec] = Field(min_length=1)  # components; names must be unique
    total: str | None = "total"  # name of the weighted total (None: no total); GRPO trains on it by default
    max_error_fraction: float = Field(0.1, ge=0.0, le=1.0)  # fail loudly above this: a broken reward is not a signal
    workers: int = Field(1, ge=1)  # >1: programmatic rewards over Ray workers, judge requests in threads


class ScoreError(RuntimeError):
    """A reward failed on too many rollouts; the message is the summary."""


def versions(config: ScoreConfig) -> dict[str, str]:
    """reward name -> version for every component and the total (raises ValueError on a bad spec)."""
    out = {s.name: reward_version(s) for s in config.rewards}
    if config.total:
        out[config.total] = total_version(config.rewards)
    return out


def part_id(batch_id: str, name: str, version: str) -> str:
    return artifact_id("score", [batch_id], {"reward": name}, f"{CODE_VERSION}:{version}")


def run(config: ScoreConfig, ctx: StageContext, batches: list[str]) -> ArtifactRef:
    """Score `batches` with every reward of `config` (computing only what is missing)."""
    specs = [fill_params(s, cache_dir=str(ctx.ws.judge_cache_dir)) for s in config.rewards]
    vers = versions(config)
    stage_config = {"rewards": vers, "total": config.total}

    def body(set_id: str, mlflow_run_id: str) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for batch_id in batches:
            metrics.update(_score_batch(config, ctx, specs, vers, batch_id))
        return metrics

    return run_stage(ctx, "reward_set", "reward_set", list(batches), stage_config, body,
                     meta={"rewards": vers, "parts": {b: {n: part_id(b, n, v) for n, v in vers.items()} for b in batches}})


def _score_batch(config: ScoreConfig, ctx: StageContext, specs: list[RewardSpec], vers: dict[str, str],
                 batch_id: str) -> dict[str, float]:
    ws = ctx.ws
    if ws.catalog.get_artifact(batch_id) is None:
        raise KeyError(f"rollout batch {batch_id!r} is not a complete artifact in this workspace")
    missing = [s for s in specs if ws.catalog.get_artifact(part_id(batch_id, s.name, vers[s.name])) is None]
    total_missing = config.total and ws.catalog.get_artifact(part_id(batch_id, config.total, vers[config.total])) is None
    if not missing and not total_missing:
        return {}
    needs_tokens = any(info(load_fn(s.fn)).tokens for s in missing)
    rollouts = _load(ws, batch_id, needs_tokens)
    metrics: dict[str, float] = {}
    computed: dict[str, list[Outcome]] = {}
    for spec in missing:
        outcomes = _compute(spec, rollouts, config.workers)
        _check_errors(spec.name, outcomes, config.max_error_fraction)
        computed[spec.name] = outcomes
    for spec in missing:  # write only after every computed reward passed its error check
        metrics.update(_write(ctx, batch_id, spec.name, vers[spec.name], rollouts, computed[spec.name]))
    if total_missing:
        components = [computed.get(s.name) or _stored(ws, batch_id, s.name, vers[s.name], rollouts) for s in specs]
        outcomes = weighted_total(specs, components)
        metrics.update(_write(ctx, batch_id, config.total, vers[config.total], rollouts, outcomes))
    return metrics


def _load(ws, batch_id: str, needs_tokens: bool) -> list[Rollout]:
    """The batch's rollouts; without the token lists unless a reward reads them (converting ~300
    token ids per rollout to Python objects would dominate the cost of rescoring)."""
    if needs_tokens:
        return from_table(ws.read_artifact(batch_id), Rollout)
    from storage.schema import ROLLOUTS

    table = ws.read_artifact(batch_id, columns=[n for n in ROLLOUTS.names if n not in TOKEN_COLUMNS])
    for col in TOKEN_COLUMNS:
        typ = ROLLOUTS.field(col).type
        table = table.append_column(col, pa.array([[]] * table.num_rows, type=typ))
    return from_table(table, Rollout)


def _compute(spec: RewardSpec, rollouts: list[Rollout], workers: int) -> list[Outcome]:
    decl = info(load_fn(spec.fn))
    if workers <= 1 or decl.kind == "group":
        # Group rewards (judges) are I/O bound: threads keep `workers` requests in flight.
        return compute(spec, rollouts, workers=workers)
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    remote = ray.remote(compute)
    step = -(-len(rollouts) // workers)
    chunks = [rollouts[i : i + step] for i in range(0, len(rollouts), step)]
    return [o for part in ray.get([remote.remote(spec, c) for c in chunks]) for o in part]


def _check_errors(name: str, outcomes: list[Outcome], max_fraction: float) -> None:
    errors = [o.error for o in outcomes if o.value is None]
    if outcomes and len(errors) / len(outcomes) > max_fraction:
        common: dict[str, int] = {}
        for e in errors:
            common[e or "?"] = common.get(e or "?", 0) + 1
        top = "; ".join(f"{n}x {e}" for e, n in sorted(common.items(), key=lambda kv: -kv[1])[:3])
        raise ScoreError(f"reward {name!r} failed on {len(errors)}/{len(outcomes)} rollouts "
                         f"(> {max_fraction:.0%} allowed); most common: {top}")


def _stored(ws, batch_id: str, name: str, version: str, rollouts: list[Rollout]) -> list[Outcome]:
    """Outcomes of an already-scored component, aligned with `rollouts` (for the weighted total)."""
    table = ws.read_artifact(part_id(batch_id, name, version), columns=["rollout_id", "value", "error"])
    by_id = {r["rollout_id"]: Outcome(r["value"], None, r["error"]) for r in table.to_pylist()}
    return [by_id.get(r.rollout_id, Outcome(None, None, "no stored value")) for r in rollouts]


def _write(ctx: StageContext, batch_id: str, name: str, version: str, rollouts: list[Rollout],
           outcomes: list[Outcome]) -> dict[str, float]:
    pid = part_id(batch_id, name, version)
    scored_at = now()  # one timestamp per part: datetime.now() per row was ~10 % of rescoring time
    rows = [RewardRow(r.rollout_id, batch_id, name, version, o.value, o.details, o.error, pid, scored_at)
            for r, o in zip(rollouts, outcomes)]
    table = to_table(rows, RewardRow)
    ctx.ws.write_part("rewards", pid, table, part="part-00000")
    ctx.ws.catalog.complete_artifact(pid, "rewards", "score", [batch_id], config_hash({"reward": name, "version": version}),
                                     meta={"reward_name": name, "reward_version": version})
    values = pc.drop_null(table["value"])
    n_err = table.num_rows - len(values)
    mean = pc.mean(values).as_py() if len(values) else float("nan")
    std = pc.stddev(values).as_py() if len(values) else float("nan")
    errors = [o.error for o in outcomes if o.error]
    print(f"scored {batch_id} {name}@{version}: mean {mean:.4g} std {std:.4g} over {len(values)} rollouts"
          + (f", {n_err} errors (first: {errors[0]})" if n_err else ""), file=sys.stderr)
    return {f"{name}.mean": mean, f"{name}.std": std, f"{name}.errors": n_err}


def latest_version(ws, batches: list[str], name: str) -> str:
    """The most recently scored version of reward `name` present for all `batches`."""
    quoted = ", ".join("'" + b.replace("'", "''") + "'" for b in batches)
    rows = ws.query(
        f"SELECT reward_version, max(scored_at) AS t, count(DISTINCT batch_id) AS nb FROM rewards "
        f"WHERE reward_name = '{name.replace(chr(39), '')}' AND batch_id IN ({quoted}) GROUP BY 1 "
        f"HAVING nb = {len(set(batches))} ORDER BY t DESC LIMIT 1"
    ).to_pylist()
    if not rows:
        raise KeyError(f"reward {name!r} has no version scored on all of {batches}")
    return rows[0]["reward_version"]


def summary(ref: ArtifactRef, ws) -> dict[str, Any]:
    """The manifest of a score run: reward name -> version, and the parts per rollout batch."""
    row = ws.catalog.get_artifact(ref.id)
    return json.loads(row["meta"]) if isinstance(row["meta"], str) else row["meta"]
