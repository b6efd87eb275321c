"""Score stage: rollout batches x a reward spec -> reward rows, one artifact per (batch, reward version).

Every (rollout batch, reward name, reward version) is its own `rewards` artifact with a
deterministic id, so:
  - rescoring with unchanged rewards finds every part in the catalog and computes nothing;
  - after editing one reward only that reward (and the weighted total, whose version follows its
    components) is computed; the total is summed from the stored component rows, not recomputed;
  - the `rewards` view holds each (rollout, reward name, version) exactly once.
The stage's own artifact (kind `reward_set`, prefix `rs-`) is the manifest tying them together:
its meta maps each reward name to its version and parts, and it is what `rlops stage score` prints.

Judge drift, watched (rewards/drift.py): every call measures each group reward (a judge) against each per-rollout
reward that is not partial (a programmatic check) on every batch it scores, from the stored rows: the agreement of
their orders within groups, the share of tied pairs, the share of groups the judge left unordered. The reward set
keeps them in its meta (`drift`: the `judge_drift` view) and its metrics (`{judge}.agreement.{truth}`, ...), and a
training step logs them as `judge/...` curves (flows/mlflow_log.py). A metric only: nothing trains on it.

Failures are data: a reward that raises or returns a bad value gives a null `value` with the reason
in `error`. If a reward's error fraction exceeds `max_error_fraction` the stage fails with a
summary before writing that reward's rows (nothing partial is ever visible).
"""

from __future__ import annotations

import gc
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field

from rewards.base import (Outcome, RewardSpec, compute, fill_params, info, load_reward, reward_version, takes, total_version,
                          weighted_total)
from rewards.drift import drift_counts, measures
from stages.cluster import connect, reserve
from stages.common import CODE_VERSION, ArtifactRef, Operational, StageContext, run_stage
from storage.ids import artifact_id, config_hash
from storage.labels import label_values
from storage.parquet import DataStore
from storage.schema import ROLLOUTS, Rollout, from_table, now, reward_table
from storage.workspace import Workspace

# Left out of the read unless a reward reads tokens; image_ids too (no reward reads images yet), so a
# batch written before schema version 3, which lacks that column, still rescores.
TOKEN_COLUMNS = ("token_ids", "loss_mask", "behavior_logprobs", "segment_starts", "image_ids")


class ScoreConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rewards: list[RewardSpec] = Field(min_length=1)  # components; names must be unique
    total: str | None = "total"  # name of the weighted total (None: no total); GRPO trains on it by default
    max_error_fraction: float = Field(0.1, ge=0.0, le=1.0)  # fail loudly above this: a broken reward is not a signal
    workers: int = Operational(1, ge=1)  # >1: programmatic rewards over Ray workers, judge requests in threads

    def default_reward(self, preferred: str | None = None) -> str:
        """The reward trained on / evaluated by: `preferred` if given, else the weighted total, else the first."""
        return preferred or self.total or self.rewards[0].name


class ScoreError(RuntimeError):
    """A reward failed on too many rollouts; the message is the summary."""


def versions(config: ScoreConfig) -> dict[str, str]:
    """reward name -> version for every component and the total (raises ValueError on a bad spec, or
    when two rewards, the total included, share a name: their rows would overwrite each other)."""
    out = {s.name: reward_version(s) for s in config.rewards}
    if len(out) < len(config.rewards):
        raise ValueError(f"reward names must be unique, got {[s.name for s in config.rewards]}")
    if config.total:
        if config.total in out:
            raise ValueError(f"the total's name {config.total!r} is also a component's name")
        out[config.total] = total_version(config.rewards)
    return out


def in_workspace(config: ScoreConfig, ws: Workspace) -> ScoreConfig:
    """`config` with what its rewards take from the workspace set where a function has the param and the spec leaves
    it unset (`rewards.base.fill_params`): the judge's response cache (`cache_dir`, unversioned), the checkpoint folder
    (`checkpoints_dir`, unversioned: `rewards.rm.learned` finds its reward model there) and people's labels
    (`labels`: rollout id -> reviewer -> value, the `human` reward's; versioned, so new labels are a new version).

    The one home of that context. The score stage fills it on every call; a pipeline fills it once at its start
    (flows/pipeline.py), so that every step's score stage and the version the update trains on
    (`RewardRef.configured`) see the same labels while someone keeps labelling. Filled params are kept."""
    context: dict[str, Any] = {"cache_dir": str(ws.judge_cache_dir),
                               "checkpoints_dir": str(ws.settings.checkpoints_dir)}  # a learned reward model's (rewards/rm.py)
    if any(takes(s, "labels") and "labels" not in s.params for s in config.rewards):
        context["labels"] = label_values(ws)  # one query, only when a reward reads labels
    return config.model_copy(update={"rewards": [fill_params(s, **context) for s in config.rewards]})


def part_id(batch_id: str, name: str, version: str) -> str:
    return artifact_id("score", [batch_id], {"reward": name}, f"{CODE_VERSION}:{version}")


def run(config: ScoreConfig, ctx: StageContext, batches: list[str]) -> ArtifactRef:
    """Score `batches` with every reward of `config` (computing only what is missing)."""
    config = in_workspace(config, ctx.ws)
    specs, vers = config.rewards, versions(config)
    stage_config = {"rewards": vers, "total": config.total}

    meta: dict[str, Any] = {"rewards": vers, "parts": {b: {n: part_id(b, n, v) for n, v in vers.items()} for b in batches}}

    def body(set_id: str, mlflow_run_id: str) -> dict[str, float]:
        placements: list[str] = []
        watched: dict[tuple[str, str], dict[str, int]] = {}
        metrics = _score_batches(config, ctx, specs, vers, batches, placements, watched)
        if placements:  # where the Ray tasks ran (stages.cluster.placement)
            ctx.ws.tracker.set_tags(mlflow_run_id, {"rlops.ray_workers": ",".join(sorted(set(placements)))})
        # run_stage records `meta` after the body: the drift rows go with the metrics (the `judge_drift` view)
        meta["drift"] = _drift_rows(watched)
        for row in meta["drift"]:
            metrics.update({f"{row['judge']}.{k}.{row['truth']}": row[k] for k in ("agreement", "tied_pairs", "pairs")
                            if row[k] is not None})
            if row["degenerate_groups"] is not None:
                metrics[f"{row['judge']}.degenerate_groups"] = row["degenerate_groups"]
        return metrics

    return run_stage(ctx, "reward_set", "reward_set", list(batches), stage_config, body, meta=meta)


def _drift_rows(watched: dict[tuple[str, str], dict[str, int]]) -> list[dict[str, Any]]:
    """One row per (judge, programmatic reward): rewards/drift.py's measures, None for an undefined one."""
    rows = []
    for (judge, truth), counts in sorted(watched.items()):
        got = measures(counts)
        rows.append({"judge": judge, "truth": truth, **{k: None if math.isnan(v) else v for k, v in got.items()}})
    return rows


def _score_batches(config: ScoreConfig, ctx: StageContext, specs: list[RewardSpec], vers: dict[str, str],
                   batches: list[str], placements: list[str],
                   watched: dict[tuple[str, str], dict[str, int]] | None = None) -> dict[str, float]:
    """Score what is missing of every batch; batches are computed in Ray workers when `workers > 1`
    and every missing reward is per-rollout (judges keep their requests in driver threads). `watched` gathers, per
    (judge, programmatic reward), the drift counts (rewards/drift.py) of every batch."""
    ws = ctx.ws
    present = ws.catalog.complete_rows(batches)
    absent = [b for b in batches if b not in present]
    if absent:
        raise KeyError(f"rollout batch(es) {', '.join(map(repr, absent))} are not complete artifacts in this workspace")
    # Two catalog queries for all batches (not a few per batch): each DuckDB connection costs ~10 ms.
    scored = set() if ctx.force else ws.catalog.complete_ids([part_id(b, n, v) for b in batches for n, v in vers.items()])
    files = ws.catalog.files_of(batches)
    todo: list[_Todo] = []
    for batch_id in batches:
        done = {n for n, v in vers.items() if part_id(batch_id, n, v) in scored}
        missing = [s for s in specs if s.name not in done]
        total_missing = bool(config.total) and config.total not in done
        if missing or total_missing:
            todo.append(_Todo(batch_id, files[batch_id], present[batch_id], missing, total_missing))
    stats: dict[str, list[float]] = {}  # name -> [count, sum, sum of squares, errors] over all batches
    for (batch_id, _, _, missing, total_missing), (ids, computed) in zip(todo, _outcomes_of(config, ctx, todo, placements)):
        for spec in missing:
            if not info(load_reward(spec)).partial:  # a partial reward's nulls are rollouts it has no value for
                _check_errors(spec.name, computed[spec.name], config.max_error_fraction)
        parts = {s.name: computed[s.name] for s in missing}
        if total_missing:
            components = [computed.get(s.name) or _stored(ws, batch_id, s.name, vers[s.name], ids) for s in specs]
            parts[config.total] = weighted_total(specs, components)
        _write(ctx, batch_id, vers, ids, parts, stats)
    if watched is not None:
        kinds = {s.name: info(load_reward(s)) for s in specs}
        # a judge: rlops' own group reward (RULER, a ranker); a peer's batch function (TRL's) is a group reward too
        judges = [s.name for s in specs if kinds[s.name].kind == "group" and s.style == "rlops"]
        truths = [s.name for s in specs if kinds[s.name].kind == "rollout" and not kinds[s.name].partial]
        for batch_id in batches if judges and truths else []:
            _watch(ws, batch_id, judges, truths, vers, watched)
    metrics: dict[str, float] = {}
    for name, (n, total, squares, errors) in stats.items():
        mean = total / n if n else float("nan")
        metrics.update({f"{name}.mean": mean, f"{name}.std": max(squares / n - mean * mean, 0.0) ** 0.5 if n else float("nan"),
                        f"{name}.errors": errors})
    return metrics


def _watch(ws: Workspace, batch_id: str, judges: list[str], truths: list[str], vers: dict[str, str],
           watched: dict[tuple[str, str], dict[str, int]]) -> None:
    """Add one batch's drift counts to `watched`: every judge (a group reward) against every programmatic reward (a
    per-rollout one that is not partial), from the batch's stored rows (computed now or before)."""
    table = ws.read_artifact(batch_id, columns=["rollout_id", "group_id"])
    ids, groups = table["rollout_id"].to_pylist(), table["group_id"].to_pylist()
    values = {name: [o.value for o in _stored(ws, batch_id, name, vers[name], ids)] for name in judges + truths}
    for judge in judges:
        for truth in truths:
            counts = drift_counts(values[judge], values[truth], groups)
            total = watched.setdefault((judge, truth), dict.fromkeys(counts, 0))
            for k, v in counts.items():
                total[k] += v


class _Todo(NamedTuple):
    batch_id: str
    files: list[str]
    rows: int
    missing: list[RewardSpec]  # components to compute
    total_missing: bool


MIN_SLICE_ROWS = 20_000  # with workers > 1, a batch of at least 2x this many rollouts is split over workers


def _slices(rows: int, workers: int) -> list[tuple[int, int] | None]:
    """Row ranges to score a batch in: the whole batch, or up to `workers` equal slices of a large one."""
    k = max(1, min(workers, rows // MIN_SLICE_ROWS))
    if k == 1:
        return [None]
    step = -(-rows // k)
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def _outcomes_of(config: ScoreConfig, ctx: StageContext, todo: list[_Todo], placements: list[str]
                 ) -> Iterator[tuple[list[str], dict[str, list[Outcome]]]]:
    """(rollout ids, reward name -> outcomes) per batch of `todo`, in order.

    With `workers` > 1 and only per-rollout rewards missing, batches (and slices of large batches)
    are scored as Ray tasks (on the run's `ray:` cluster, or a local Ray), a few more in flight than
    workers so the driver writes while they compute; each task's placement is appended to `placements`.
    """
    root = ctx.ws.data.root
    remote = config.workers > 1 and all(info(load_reward(s)).kind == "rollout" for t in todo for s in t.missing)
    if not remote:
        for t in todo:
            yield score_files(root, t.files, t.missing, workers=config.workers)
        return
    import ray

    connect(ctx.ray, num_cpus=config.workers)
    reserve(1, f"a score task (score.workers: {config.workers})", ctx.ray.placement_timeout_s)  # one task's CPU; more tasks queue for theirs
    task = ray.remote(_score_placed)
    units = [(i, t, rows) for i, t in enumerate(todo) for rows in _slices(t.rows, config.workers)]
    window = 2 * config.workers
    pending = [task.remote(root, t.files, t.missing, 1, rows) for _, t, rows in units[:window]]
    done: list[tuple[list[str], dict[str, list[Outcome]]]] = []
    for u, (i, t, _) in enumerate(units):
        result, where = ray.get(pending[u])
        done.append(result)
        placements.append(where)
        pending[u] = None  # drop the reference: the object store frees the result
        if u + window < len(units):
            _, nt, rows = units[u + window]
            pending.append(task.remote(root, nt.files, nt.missing, 1, rows))
        if u + 1 == len(units) or units[u + 1][0] != i:  # the batch's last slice: hand the batch over whole
            ids = [r for part_ids, _ in done for r in part_ids]
            yield ids, {s.name: [o for _, part in done for o in part[s.name]] for s in t.missing}
            done = []


def score_files(data_root: str, files: list[str], specs: list[RewardSpec], workers: int = 1,
                rows: tuple[int, int] | None = None) -> tuple[list[str], dict[str, list[Outcome]]]:
    """Read one rollout batch's files (or rows [start, stop) of them) and compute `specs` over those
    rollouts: (rollout ids, name -> outcomes).

    Self-contained (a data root, paths, specs in; plain values out), so it runs the same in the
    driver and in a Ray worker. `workers` > 1 gives group rewards (judges) that many request threads.
    """
    needs_tokens = any(info(load_reward(s)).tokens for s in specs)
    with _gc_paused():
        rollouts = _load(DataStore(data_root), files, needs_tokens, rows)
        computed = {s.name: compute(s, rollouts, workers=workers if info(load_reward(s)).kind == "group" else 1)
                    for s in specs}
        return [r.rollout_id for r in rollouts], computed


def _score_placed(*args: Any) -> tuple[tuple[list[str], dict[str, list[Outcome]]], str]:
    """`score_files` in a Ray task, with where it ran (stages.cluster.placement)."""
    from stages.cluster import placement

    return score_files(*args), placement()


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Rollout records hold no reference cycles, so reference counting frees them; the cyclic GC only
    rescans the ever-growing heap while a batch is decoded (that doubled the cost of rescoring)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _load(data: DataStore, files: list[str], needs_tokens: bool, rows: tuple[int, int] | None = None) -> list[Rollout]:
    """The batch's rollouts (or rows [start, stop) of it); without the token lists unless a reward
    reads them (converting ~300 token ids per rollout to Python objects would dominate the cost of
    rescoring). Reading the Arrow columns is cheap next to decoding, so a slice reads them all."""
    if needs_tokens:
        table = data.read(files)
        return from_table(table if rows is None else table.slice(rows[0], rows[1] - rows[0]), Rollout)
    table = data.read(files, columns=[n for n in ROLLOUTS.names if n not in TOKEN_COLUMNS])
    if rows is not None:
        table = table.slice(rows[0], rows[1] - rows[0])
    for col in TOKEN_COLUMNS:
        table = table.append_column(col, pa.array([[]] * table.num_rows, type=ROLLOUTS.field(col).type))
    return from_table(table, Rollout)


def _check_errors(name: str, outcomes: list[Outcome], max_fraction: float) -> None:
    errors = [o.error for o in outcomes if o.value is None and o.applicable]  # "not applicable" is no failure
    if outcomes and len(errors) / len(outcomes) > max_fraction:
        common: dict[str, int] = {}
        for e in errors:
            common[e or "?"] = common.get(e or "?", 0) + 1
        top = "; ".join(f"{n}x {e}" for e, n in sorted(common.items(), key=lambda kv: -kv[1])[:3])
        raise ScoreError(f"reward {name!r} failed on {len(errors)}/{len(outcomes)} rollouts "
                         f"(> {max_fraction:.0%} allowed); most common: {top}")


def _stored(ws, batch_id: str, name: str, version: str, rollout_ids: list[str]) -> list[Outcome]:
    """Outcomes of an already-scored component, aligned with `rollout_ids` (for the weighted total)."""
    table = ws.read_artifact(part_id(batch_id, name, version), columns=["rollout_id", "value", "error"])
    by_id = dict(zip(table["rollout_id"].to_pylist(), zip(table["value"].to_pylist(), table["error"].to_pylist())))
    return [Outcome(*by_id[r]) if r in by_id else Outcome(None, None, "no stored value") for r in rollout_ids]


def _write(ctx: StageContext, batch_id: str, vers: dict[str, str], rollout_ids: list[str],
           parts: dict[str, list[Outcome]], stats: dict[str, list[float]]) -> None:
    """Write one `rewards` artifact per reward name of `parts`, all made visible in one catalog
    transaction; add each one's count, sum, sum of squares and errors to `stats`."""
    scored_at = now()  # one timestamp per batch: datetime.now() per row was ~10 % of rescoring time
    items = []
    for name, outcomes in parts.items():
        pid = part_id(batch_id, name, vers[name])
        table = reward_table(rollout_ids, batch_id, name, vers[name], [o.value for o in outcomes],
                             [o.details_json or o.details for o in outcomes], [o.error for o in outcomes], pid, scored_at)
        items.append((pid, table, [batch_id], config_hash({"reward": name, "version": vers[name]}),
                      {"reward_name": name, "reward_version": vers[name]}))
        values = pc.drop_null(table["value"])
        n_err = table.num_rows - table["error"].null_count  # a null value without an error is "not applicable"
        mean = pc.mean(values).as_py() if len(values) else float("nan")
        std = pc.stddev(values).as_py() if len(values) else float("nan")
        first = next((o.error for o in outcomes if o.error), None)
        print(f"scored {batch_id} {name}@{vers[name]}: mean {mean:.4g} std {std:.4g} over {len(values)} rollouts"
              + (f", {n_err} errors (first: {first})" if n_err else ""), file=sys.stderr)
        acc = stats.setdefault(name, [0, 0.0, 0.0, 0])
        acc[0] += len(values)
        acc[1] += pc.sum(values).as_py() or 0.0
        acc[2] += pc.sum(pc.multiply(values, values)).as_py() or 0.0
        acc[3] += n_err
    ctx.ws.write_artifacts("rewards", "score", items)

