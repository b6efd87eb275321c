"""What every stage shares: the artifact reference, the run context, and `run_stage`, which
turns a stage body into a cached, recorded, tracked execution.

    ref = run_stage(ctx, "score", kind="rewards", inputs=[batch_id], config=cfg, version=v, body=body)

`run_stage` computes the deterministic artifact id; if the catalog already holds a complete
artifact with that id it returns it without running anything (a "cached" stage run). Otherwise
it opens an MLflow child run, calls `body(artifact_id, mlflow_run_id)` — which writes and
registers the artifact's files and returns metrics — then marks the artifact complete, logs
the metrics and records the stage run. A body that raises leaves the artifact incomplete
(invisible), records the failure with its reason, and re-raises.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import BaseModel, Field

from stages.cluster import RayConfig
from storage.ids import artifact_id as make_id
from storage.ids import config_hash
from storage.schema import now
from storage.workspace import Workspace

CODE_VERSION = "1"  # bump when a stage's output for the same inputs and config changes
_OPERATIONAL = "rlops_operational"
_ADDED = "rlops_added"


def Operational(default: Any, **kwargs: Any) -> Any:  # noqa: N802 - used like pydantic's Field
    """A config field that changes how a stage runs (workers, shard size, memory layout), never what it
    produces: `identity` leaves it out, so it never enters an artifact id. Marked on the config types
    themselves, so the decision has one home per field."""
    return Field(default, json_schema_extra={_OPERATIONAL: True}, **kwargs)


def Added(default: Any, **kwargs: Any) -> Any:  # noqa: N802 - used like pydantic's Field
    """A config field added after artifacts existed, whose default reproduces what the code did before:
    it enters an id only when set to another value, so adding it changes no existing id."""
    return Field(default, json_schema_extra={_ADDED: True}, **kwargs)


def _marked(f: Any, marker: str) -> bool:
    return isinstance(f.json_schema_extra, dict) and bool(f.json_schema_extra.get(marker))


def identity(value: Any) -> Any:
    """The id-bearing part of a stage config: pydantic models as dicts without their `Operational`
    fields, nor their `Added` fields at default (recursively), other values as they are. `run_stage`
    hashes this, nothing else."""
    if isinstance(value, BaseModel):
        return {name: identity(getattr(value, name)) for name, f in type(value).model_fields.items()
                if not _marked(f, _OPERATIONAL) and not (_marked(f, _ADDED) and getattr(value, name) == f.default)}
    if isinstance(value, dict):
        return {k: identity(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [identity(v) for v in value]
    return value


@dataclass(frozen=True)
class ArtifactRef:
    id: str
    kind: str  # rollouts | rewards | evals | checkpoint
    cached: bool = False  # True when it existed and nothing was computed


@dataclass
class StageContext:
    """Where a stage runs: the workspace and the pipeline run it belongs to (if any)."""

    ws: Workspace
    run_name: str | None = None
    parent_run_id: str | None = None  # MLflow parent run (the pipeline run)
    prefect_flow_run_id: str | None = None
    force: bool = False  # recompute even if a complete artifact exists
    tags: dict[str, str] = field(default_factory=dict)
    ray: RayConfig = field(default_factory=RayConfig)  # where Ray work runs (the run config's `ray:` section)
    # The run's resident policy (stages.policy.session.PolicySession): models stay loaded between stage calls.
    # None: each stage loads what it needs from files. Never part of an artifact's identity.
    session: Any = None


def run_stage(
    ctx: StageContext,
    stage: str,
    kind: str,
    inputs: list[str],
    config: dict[str, Any],
    body: Callable[[str, str], dict[str, float]],
    version: str = "",
    meta: dict[str, Any] | None = None,
) -> ArtifactRef:
    """Run `body` once per (stage, inputs, config, version); see the module docstring.

    `config` may hold pydantic configs: their `Operational` fields are dropped (`identity`) before hashing."""
    config = identity(config)
    aid = make_id(stage, inputs, config, f"{CODE_VERSION}:{version}")
    chash = config_hash(config)
    record = {"stage": stage, "artifact_id": aid, "inputs": inputs, "config_hash": chash,
              "prefect_flow_run_id": ctx.prefect_flow_run_id, "run_name": ctx.run_name}
    if not ctx.force and ctx.ws.catalog.get_artifact(aid) is not None:
        ctx.ws.catalog.record_stage_run({**record, "status": "cached", "started_at": now(), "finished_at": now()})
        return ArtifactRef(aid, kind, cached=True)

    started, run_id = now(), None
    tracker = ctx.ws.tracker
    try:
        with tracker.stage_run(stage, ctx.parent_run_id, aid, tags=ctx.tags,
                               params={"inputs": ",".join(inputs), **config}) as run_id:
            metrics = body(aid, run_id) or {}
            ctx.ws.catalog.complete_artifact(aid, kind, stage, inputs, chash, meta={**(meta or {}), "metrics": metrics})
            tracker.log_metrics(run_id, metrics)
    except BaseException as e:
        ctx.ws.catalog.record_stage_run({**record, "status": "failed", "started_at": started, "finished_at": now(),
                                         "error": "".join(traceback.format_exception_only(e)).strip()[:2000],
                                         "mlflow_run_id": run_id})
        raise
    ctx.ws.catalog.record_stage_run({**record, "status": "complete", "started_at": started, "finished_at": now(),
                                     "mlflow_run_id": run_id})
    return ArtifactRef(aid, kind)


def base_policy(ws: Workspace, base_model: str) -> str:
    """The policy id of a base model without adapter, registered in the catalog on first use.

    The id covers the model's name and its content fingerprint (stages.policy.model.fingerprint: config,
    weights and tokenizer files), so a folder whose weights change under the same name is a new
    base policy, and everything generated or trained from it gets new ids. A vision-language model's id
    also covers its processor's image settings (`stages.policy.vlm.processor_fingerprint`): they decide
    the pixels and placeholder tokens each image becomes."""
    from stages.policy.model import fingerprint
    from stages.policy.vlm import is_vision_language_model, model_processor_fingerprint

    identity_ = {"base_model": base_model, "fingerprint": fingerprint(base_model)}
    if is_vision_language_model(base_model):
        identity_["processor"] = model_processor_fingerprint(base_model)
    pid = make_id("base", [], identity_)
    if ws.catalog.get_checkpoint(pid) is None:
        ws.catalog.add_checkpoint({"policy_id": pid, "parent_id": None, "base_model": base_model, "kind": "base",
                                   "adapter_uri": None, "step": 0, "trained_on": identity_, "config_hash": None})
        ws.catalog.complete_artifact(pid, "checkpoint", "base", [], config_hash(identity_))
    return pid


def resolve_policy(ws: Workspace, policy_id: str) -> tuple[str, str | None]:
    """policy_id -> (base model reference, adapter folder or None)."""
    row = ws.catalog.get_checkpoint(policy_id)
    if row is None:
        raise KeyError(f"unknown policy {policy_id!r}: not in the catalog (see `rlops ls checkpoints`)")
    return row["base_model"], row["adapter_uri"]


def vision_language_base(ws: Workspace, policy_id: str) -> str | None:
    """The base model of `policy_id` when it is a vision-language model (stages/policy/vlm_episodes.py lists what
    such a policy supports); None for a text model, and for a policy the catalog does not know (the stage then
    fails on it as for any policy)."""
    from stages.policy.vlm import is_vision_language_model

    row = ws.catalog.get_checkpoint(policy_id)
    return row["base_model"] if row is not None and is_vision_language_model(row["base_model"]) else None
