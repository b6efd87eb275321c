"""Prefect flows: the pipeline, one flow per stage for reruns, rescore/retrain, and the scheduled run.

Flows do not turn prints into Prefect logs (`log_prints` stays off): libraries print from stage
threads (dill disassembles functions to stdout while datasets fingerprints TRL's map functions), and
Prefect's print patch would forward that into the console and the run's logs. Stage progress reaches
the terminal directly, and each step's summary line goes through the run logger (`_on_step`).

Flows are thin: they open the workspace, tie the run to an MLflow parent run and a catalog `runs`
row, and hand `flows.pipeline` a `call` that runs each stage as a Prefect task. Stage results are
cached by the catalog (artifact ids), not by Prefect's result store: a task is re-entered on a
rerun and returns at once when its artifact exists, so Prefect and the catalog cannot disagree,
and a lost Prefect database loses nothing. Tasks retry transient errors (I/O, connections), never
config or data errors.
"""

from __future__ import annotations

import contextvars
import importlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NONE
from prefect.context import get_run_context

from flows import pipeline
from flows.resume import parent_run
from flows.run_config import RunConfig, from_dict
from stages.common import ArtifactRef, StageContext
from storage.schema import now
from storage.workspace import Workspace

TRANSIENT = (OSError, ConnectionError, TimeoutError)


def _transient(task_obj: Any, task_run: Any, state: Any) -> bool:
    try:
        state.result()
    except TRANSIENT:
        return True
    except BaseException:  # noqa: BLE001 - any other failure is not worth retrying
        return False
    return False


def run_here(flow_obj: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a flow in this process, as the CLI does (`rlops run`, `rescore`, `retrain`, `stage --prefect`).

    With no Prefect server configured (no PREFECT_API_URL), the flow reports to a temporary server that
    rlops starts (flows/temp_server.py): Prefect's own, started without importing Prefect's server into
    this process, watched so it dies with this process, and at a lower CPU priority (niceness 10,
    `RLOPS_PREFECT_SERVER_NICE`; 0 opts out): measured on 2 cores, it spends ~0.7-1.3 s of CPU recording
    the events of a 17-task run, which it then takes from the gaps, not from the training threads.

    Flow-run heartbeats are off here unless PREFECT_FLOWS_HEARTBEAT_FREQUENCY is set: they only feed
    a crash-detection automation (rlops resumes from the catalog instead), and Prefect's heartbeat
    thread sleeps in 1 s slices that the engine joins at exit, which cost ~0.4 s per run. Served
    deployments (`rlops schedule`) keep Prefect's default.

    While the temporary server boots, the modules the flow will import anyway are imported (`PRELOAD`: for a
    training flow torch, transformers, peft and MLflow's client, ~6 s of CPU), so the driver's start-up overlaps the
    server's instead of following it. Nothing is preloaded when a server is configured (the flow starts at once).
    """
    from prefect.settings import (PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
                                  PREFECT_SERVER_EPHEMERAL_ENABLED, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
                                  temporary_settings)

    updates: dict[Any, Any] = {}
    if not os.environ.get("PREFECT_FLOWS_HEARTBEAT_FREQUENCY"):
        updates[PREFECT_FLOWS_HEARTBEAT_FREQUENCY] = None
    if not PREFECT_API_URL.value() and PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        from flows.temp_server import TemporaryServer

        server = TemporaryServer(niceness=int(os.environ.get("RLOPS_PREFECT_SERVER_NICE", SERVER_NICENESS)))
        preload = PRELOAD.get(getattr(flow_obj, "name", ""), ("mlflow.tracking",))
        updates[PREFECT_API_URL] = server.start(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value(),
                                                meanwhile=lambda: [importlib.import_module(m) for m in preload])
    with temporary_settings(updates):
        return flow_obj(*args, **kwargs)


SERVER_NICENESS = 10
# What a flow's stages import in the driver, imported while the temporary server boots (`run_here`); by flow name.
# Training: the model, its adapter (peft imports torch and transformers' modelling), MLflow's client.
TRAINING_MODULES = ("peft", "mlflow.tracking")
PRELOAD = {"rlops-train": TRAINING_MODULES, "rlops-retrain": TRAINING_MODULES}


def prefect_call(name: str, fn: Callable[..., ArtifactRef], *args: Any, **kwargs: Any) -> ArtifactRef:
    """Run one stage call as a Prefect task named after the stage and step."""
    stage = task(fn, name=name.split("-")[0], task_run_name=name, cache_policy=NONE, retries=2,
                 retry_delay_seconds=5, retry_condition_fn=_transient, persist_result=False)
    return stage(*args, **kwargs)


def _context(ws: Workspace, cfg: RunConfig, fork: dict[str, Any] | None = None) -> StageContext:
    """Continue the run's MLflow parent run if it is unfinished (closing what a killed driver left
    RUNNING), else start one; record the run (and, for a fork, where it starts: `flows.step_data.fork_record`)."""
    tags = {"rlops.run_name": cfg.name} | {f"rlops.{k}": str(v) for k, v in (fork or {}).items()}
    parent = parent_run(ws, cfg.name, title=f"pipeline:{cfg.name}", tags=tags, params=cfg.model_dump(mode="json"))
    ws.catalog.upsert_run(cfg.name, _run_record(cfg, fork), parent, "running")
    flow_run = get_run_context().flow_run
    return StageContext(ws, run_name=cfg.name, parent_run_id=parent, prefect_flow_run_id=str(flow_run.id), ray=cfg.ray)


def _run_record(cfg: RunConfig, fork: dict[str, Any] | None) -> dict[str, Any]:
    """The `runs` row's config: the run config, and where a fork started (`flows.step_data.fork_record`)."""
    return cfg.model_dump(mode="json") | (fork or {})


def _finish(ws: Workspace, ctx: StageContext, cfg: RunConfig, result: pipeline.TrainResult,
            gate: bool, fork: dict[str, Any] | None = None, baseline: str | None = None) -> dict[str, Any]:
    from flows.mlflow_log import log_models
    from flows.promotion import gate as promotion_gate

    final = result.evals.get(result.final, {})
    log_models(ws, ctx.parent_run_id, cfg.name, [result.final] if cfg.mlflow_models == "final"
               else [p for p in [result.sft, *result.policies] if p], final=result.final)
    # Champion or not: registered, gated and recorded on this run before it ends (flows/promotion.py).
    promotion = (promotion_gate(cfg, ctx, result.final, prefect_call, baseline=baseline)
                 if gate or cfg.promote is not None else None)
    ws.tracker.log_metrics(ctx.parent_run_id, {f"final.{k}": v for k, v in final.items()})
    ws.tracker.set_tags(ctx.parent_run_id, {"rlops.final_policy": result.final})
    ws.tracker.end_run(ctx.parent_run_id)
    ws.catalog.upsert_run(cfg.name, _run_record(cfg, fork), ctx.parent_run_id, "complete", finished_at=now())
    rows = [{"policy": p, **{k: round(v, 4) for k, v in m.items()}} for p, m in result.evals.items()]
    if rows:
        create_table_artifact(rows, key=_key(cfg.name, "evals"), description=f"evaluations of run {cfg.name}")
    return {"run_name": cfg.name, "final": result.final, "base": result.base, "sft": result.sft,
            "evals": result.evals, "policies": result.policies, "batches": result.batches,
            "mlflow_run_id": ctx.parent_run_id, "promotion": promotion}


def _key(*parts: str) -> str:
    # Prefect artifact keys: lowercase letters, numbers and dashes only.
    return "-".join("".join(c if c.isalnum() else "-" for c in p.lower()) for p in parts)


class _Background:
    """Calls that only feed the Prefect UI (artifacts) run on one background thread, in the flow
    run's context, so the pipeline never waits on the API server for them; `wait` joins them and
    logs (never raises) a failure: a missing artifact must not fail a training run."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlops-prefect-artifacts")
        self.futures: list[Any] = []

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.futures.append(self.pool.submit(contextvars.copy_context().run, fn, *args, **kwargs))

    def wait(self) -> None:
        for f in self.futures:
            try:
                f.result()
            except Exception as e:  # noqa: BLE001 - see the class docstring
                get_run_logger().warning(f"could not create a Prefect artifact: {type(e).__name__}: {e}")
        self.pool.shutdown()


def _on_step(cfg: RunConfig, background: _Background, ctx: StageContext) -> Callable[[dict[str, Any]], None]:
    from flows.mlflow_log import log_step

    logger = get_run_logger()

    def report(row: dict[str, Any]) -> None:
        log_step(ctx.ws, ctx.parent_run_id, row, warm_started=cfg.sft is not None)  # curves on the MLflow parent run
        logger.info(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        title = f"step {row['step']}" if "step" in row else f"evaluation of {row['eval']}"
        table = "\n".join(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in row.items())
        background.submit(create_markdown_artifact, f"### {cfg.name}: {title}\n\n| field | value |\n|---|---|\n{table}\n",
                          key=_key(cfg.name, "step" if "step" in row else "eval"), description=f"{cfg.name} {title}")

    return report


@flow(name="rlops-train")
def train_flow(config: dict[str, Any], workspace: str | None = None, continue_lineage: bool = False,
               gate: bool = False, fork_from: str | None = None) -> dict[str, Any]:
    """The whole pipeline for one config. `continue_lineage` starts from the run's latest checkpoint
    (scheduled retraining) instead of the base model; `gate` applies the promotion gate even without a
    `promote:` section (scheduled runs). `fork_from` (`rlops run --from`: RUN@STEP, RUN@latest or a
    checkpoint id) starts a new lineage there, generating its own rollouts; the run's `runs` row and MLflow
    run record where it came from."""
    from flows.step_data import fork_point, fork_record

    cfg = from_dict(config)
    ws = Workspace.open(workspace)
    fork = None
    if fork_from:
        fork = fork_record(fork_from, *fork_point(ws, fork_from))
        if continue_lineage:
            raise ValueError("a run continues its own lineage or forks another, not both")
    ctx = _context(ws, cfg, fork)
    start_policy, start_step = pipeline.lineage_end(ws, cfg.name) if continue_lineage else (None, 0)
    if fork:
        start_policy, start_step = fork["fork_policy"], fork["fork_step"]
    background = _Background()
    try:
        result = pipeline.train(cfg, ctx, prefect_call, start_policy, start_step, on_step=_on_step(cfg, background, ctx),
                                fork=fork is not None)
    finally:
        background.wait()
    return _finish(ws, ctx, cfg, result, gate, fork)


@flow(name="rlops-scheduled-train")
def scheduled_train_flow(config_path: str, workspace: str | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """A scheduled run: re-reads the config file (so edited rewards and added task prompts are picked
    up), continues the run's lineage from its latest checkpoint, and gates its final checkpoint against
    the serving champion (flows/promotion.py), every time."""
    from flows.run_config import load_run_config

    cfg = load_run_config(config_path, overrides, workspace)
    if cfg.task.name == "traffic":  # the deployment loop: the night's traffic, from the champion (flows/nightly.py)
        return traffic_night_flow(cfg.model_dump(mode="json"), workspace)
    return train_flow(cfg.model_dump(mode="json"), workspace, continue_lineage=True, gate=True)


@flow(name="rlops-traffic-night")
def traffic_night_flow(config: dict[str, Any], workspace: str | None = None) -> dict[str, Any]:
    """One night of the deployment loop (flows/nightly.py): the traffic served since the last complete night,
    trained from the champion, gated by the config's judge against it (or the base model before the first
    champion), promoted when it wins. A night without train or held-out scenarios is recorded as skipped."""
    from flows import nightly
    from tasks.base import load_task

    ws = Workspace.open(workspace)
    night = nightly.open_night(ws, from_dict(config).name)
    try:
        cfg = nightly.night_config(from_dict(config), night, ws)
        task = load_task(cfg.task.name, cfg.task.params)
        counts = {"calls": nightly.window_calls(ws, night), "scenarios_train": len(task.prompts("train")),
                  "scenarios_heldout": len(task.prompts(cfg.eval.split))}
        if not counts["scenarios_train"] or not counts["scenarios_heldout"]:
            get_run_logger().info(f"night {night['night_id']}: nothing to train or gate on ({counts}); skipped")
            return nightly.close_night(ws, night, status="skipped", **counts)
        ctx = _context(ws, cfg)
        start, step = nightly.start_policy(ws, cfg)
        background = _Background()
        try:
            result = pipeline.train(cfg, ctx, prefect_call, start, step, on_step=_on_step(cfg, background, ctx))
        finally:
            background.wait()
        out = _finish(ws, ctx, cfg, result, gate=True, baseline=start or result.base)
        nightly.trace_night(ws, night, result.batches, ctx.parent_run_id)  # what it served and trained, in MLflow
    except BaseException as e:
        nightly.close_night(ws, night, status="failed", error=f"{type(e).__name__}: {e}"[:2000])
        raise
    promotion = out["promotion"] or {}
    row = nightly.close_night(ws, night, status="complete", start_policy=start or result.base, final_policy=out["final"],
                              promotion_id=promotion.get("promotion_id"), promoted=promotion.get("promoted"),
                              mlflow_run_id=ctx.parent_run_id, prefect_flow_run_id=ctx.prefect_flow_run_id, **counts)
    return {**out, "night": row}


@flow(name="rlops-rescore")
def rescore_flow(config: dict[str, Any], run_name: str, workspace: str | None = None) -> list[str]:
    """Rescore every stored training batch of `run_name` with the config's rewards (no generation)."""
    cfg = from_dict(config)
    ws = Workspace.open(workspace)
    ctx = StageContext(ws, run_name=run_name, prefect_flow_run_id=str(get_run_context().flow_run.id), ray=cfg.ray)
    return [r.id for r in pipeline.rescore(cfg, ctx, run_name, prefect_call)]


@flow(name="rlops-retrain")
def retrain_flow(config: dict[str, Any], from_policy: str, run_name: str, workspace: str | None = None,
                 branch: str | None = None) -> list[str]:
    """Replay `run_name`'s GRPO updates from `from_policy` on its rescored rollouts into a new branch."""
    cfg = from_dict(config)
    ws = Workspace.open(workspace)
    branch = branch or f"{run_name}-retrain"
    parent = parent_run(ws, branch, title=f"retrain:{branch}", tags={"rlops.run_name": branch, "rlops.from_policy": from_policy,
                                                                     "rlops.replayed_run": run_name})
    ctx = StageContext(ws, run_name=branch, parent_run_id=parent, prefect_flow_run_id=str(get_run_context().flow_run.id),
                       ray=cfg.ray)
    ws.catalog.upsert_run(branch, {"retrain_of": run_name, "from_policy": from_policy, **cfg.model_dump(mode="json")},
                          parent, "running")
    lineage = pipeline.retrain(cfg, ctx, from_policy, run_name, prefect_call)
    from flows.mlflow_log import log_models, log_step

    for policy in lineage:  # the branch's curves and its final adapter, as for a pipeline run
        log_step(ws, parent, {"policy": policy}, warm_started=False)
    log_models(ws, parent, branch, lineage[-1:], final=lineage[-1])
    ws.tracker.end_run(parent)
    ws.catalog.upsert_run(branch, {"retrain_of": run_name, "from_policy": from_policy, **cfg.model_dump(mode="json")},
                          parent, "complete", finished_at=now())
    return lineage


@flow(name="rlops-stage")
def stage_flow(stage: str, config: dict[str, Any], workspace: str | None = None, **inputs: Any) -> str:
    """One stage on its own (reruns): `stage` is sft | rollout | score | grpo | evaluate."""
    from flows.stage_calls import call_stage

    cfg = from_dict(config)
    ws = Workspace.open(workspace)
    ctx = StageContext(ws, run_name=cfg.name, prefect_flow_run_id=str(get_run_context().flow_run.id), ray=cfg.ray)
    return call_stage(stage, cfg, ctx, prefect_call, **inputs).id
