"""The pipeline commands of `rlops` (run, stage, rescore, retrain, schedule, report, inspect, ui, eval, rewards;
promote, rollback and export are flows/release.py's).

Each validates its config before importing anything heavy or computing anything; a bad config
prints one message listing every problem and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from flows.registry import command, guard, print_rows


def _config(args: argparse.Namespace):  # -> RunConfig
    from flows.run_config import load_run_config

    return load_run_config(args.config, args.set, args.workspace)


def _prefect_env(workspace: Path) -> None:
    """Keep Prefect's state in the workspace unless a server or home is configured, and create the
    MLflow database first, in this thread: its SQLite migrations must not race the temporary Prefect
    server's own migrations or a stage thread."""
    from flows.console import quiet_console
    from storage.workspace import Workspace

    quiet_console(workspace)
    ws = Workspace.open(workspace)
    ws.tracker
    if not os.environ.get("PREFECT_API_URL") and not os.environ.get("PREFECT_HOME"):
        from flows.prefect_db import seed

        os.environ["PREFECT_HOME"] = str(ws.settings.prefect_home)
        seed(ws.settings.prefect_home)  # made if missing (Prefect's SQLite cannot make it), with a migrated database
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")  # 2 slow cores
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no network here; avoids error spam


def _workspace_path(args: argparse.Namespace) -> Path:
    from storage.settings import Settings

    return Settings.from_env(args.workspace).workspace


def _emit(args: argparse.Namespace, payload: dict[str, Any], last_line: str) -> None:
    """Print the created artifact's id as the last line (or one JSON object with --json)."""
    print(json.dumps(payload, default=str) if args.json else last_line)


def results_table(summary: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """base vs SFT vs final on the held-out split, one row per metric."""
    evals = summary["evals"]
    cols = [("base", summary["base"]), ("sft", summary.get("sft")), ("final", summary["final"])]
    cols = [(label, pid) for label, pid in cols if pid and pid in evals]
    metrics = sorted({m for _, pid in cols for m in evals[pid]})
    return ["metric"] + [f"{label} ({pid[:11]})" for label, pid in cols], [
        [m] + [round(evals[pid].get(m, float("nan")), 4) for _, pid in cols] for m in metrics
    ]


@command("run")
@guard
def cmd_run(args: argparse.Namespace) -> int:
    cfg = _config(args)
    from flows import pipeline, step_data

    pipeline.prepare_cluster(cfg)  # before the temporary Prefect server: a run too big for its cluster fails fast
    ws_path = _workspace_path(args)
    step_data.check_fork(ws_path, args.fork_from)  # a --from naming no checkpoint fails before the Prefect server starts
    _prefect_env(ws_path)
    from flows.nightly import pinned
    from flows.prefect_flows import run_here, train_flow
    from storage.workspace import Workspace

    cfg = pinned(Workspace.open(ws_path), cfg)  # a traffic task's window closes now (or where a killed attempt closed it)

    summary = run_here(train_flow, cfg.model_dump(mode="json"), str(ws_path), fork_from=args.fork_from)
    if not args.json:
        cols, rows = results_table(summary)
        print(f"\nrun {cfg.name}: held-out {cfg.eval.split} split of {cfg.task.name}")
        print_rows(cols, rows)
        if summary["promotion"]:
            from flows.release import describe

            print(f"\n{describe(summary['promotion'])}")
        print(f"\nnext: rlops sql \"SELECT * FROM evals WHERE policy_id = '{summary['final']}'\" --workspace {ws_path}")
        print(f"      rlops inspect {cfg.name} --workspace {ws_path}     # best and worst episodes per reward version")
        print(f"      rlops report {cfg.name} --workspace {ws_path}      # PNGs, the run page and inspect pages")
        print(f"      rlops ui mlflow --workspace {ws_path}   (or: rlops ui prefect)")
    _emit(args, summary, summary["final"])
    return 0


@command("night")
@guard
def cmd_night(args: argparse.Namespace) -> int:
    cfg = _config(args)
    if cfg.task.name != "traffic":
        print(f"error: `rlops night` runs the deployment loop's night on a `task: traffic` config; {args.config} has "
              f"task {cfg.task.name!r} (`rlops run` trains it)", file=sys.stderr)
        return 2
    ws_path = _workspace_path(args)
    _prefect_env(ws_path)
    from flows.prefect_flows import run_here, traffic_night_flow

    summary = run_here(traffic_night_flow, cfg.model_dump(mode="json"), str(ws_path))
    night = summary.get("night", summary)
    print(f"night {night['night_id']} ({night['since'] or 'the beginning'} .. {night['until']}): {night['status']}, "
          f"{night['calls']} calls, {night['scenarios_train']} train / {night['scenarios_heldout']} held-out scenarios")
    if summary.get("promotion"):
        from flows.release import describe

        print(describe(summary["promotion"]))
    _emit(args, {k: v for k, v in night.items()}, night.get("final_policy") or night["status"])
    return 0


@command("stage")
@guard
def cmd_stage(args: argparse.Namespace) -> int:
    cfg = _config(args)
    from flows.stage_calls import call_stage
    from stages.common import StageContext
    from storage.workspace import Workspace

    inputs = dict(policy=args.policy, rollouts=args.rollouts, reward=args.reward, data=args.data, step=args.step,
                  split=args.split, labels=args.labels, reviewer=args.reviewer)
    if args.prefect:
        _prefect_env(_workspace_path(args))
        from flows.prefect_flows import run_here, stage_flow

        artifact = run_here(stage_flow, args.stage, cfg.model_dump(mode="json"), str(_workspace_path(args)), **inputs)
    else:  # quick path: no Prefect server start for one stage
        from flows.console import quiet_console

        quiet_console(_workspace_path(args))
        ws = Workspace.open(args.workspace)
        artifact = call_stage(args.stage, cfg, StageContext(ws, run_name=cfg.name, ray=cfg.ray), **inputs).id
    _emit(args, {"stage": args.stage, "artifact_id": artifact}, artifact)
    return 0


@command("rescore")
@guard
def cmd_rescore(args: argparse.Namespace) -> int:
    cfg = _config(args)
    _prefect_env(_workspace_path(args))
    from flows.prefect_flows import rescore_flow, run_here

    ids = run_here(rescore_flow, cfg.model_dump(mode="json"), args.run, str(_workspace_path(args)))
    _emit(args, {"reward_sets": ids}, "\n".join(ids))
    return 0


@command("retrain")
@guard
def cmd_retrain(args: argparse.Namespace) -> int:
    cfg = _config(args)
    _check_replay_inputs(_workspace_path(args), args.from_policy, args.run)
    _prefect_env(_workspace_path(args))
    from flows.prefect_flows import retrain_flow, run_here

    lineage = run_here(retrain_flow, cfg.model_dump(mode="json"), args.from_policy, args.run, str(_workspace_path(args)), args.branch)
    _emit(args, {"lineage": lineage}, lineage[-1])
    return 0


def _check_replay_inputs(ws_path: Path, from_policy: str, run_name: str) -> None:
    """Fail before any Prefect server start or MLflow run when the policy or the run is unknown."""
    from flows.pipeline import run_batches
    from stages.common import StageContext
    from storage.workspace import Workspace

    ws = Workspace.open(ws_path)
    if ws.catalog.get_checkpoint(from_policy) is None:
        raise KeyError(f"unknown policy {from_policy!r}: not in the catalog of {ws_path} (see `rlops ls checkpoints`)")
    run_batches(StageContext(ws), run_name)  # KeyError naming the run when it has no training batches


@command("schedule")
@guard
def cmd_schedule(args: argparse.Namespace) -> int:
    cfg = _config(args)
    from flows.schedule import serve

    return serve(cfg, Path(args.config).resolve(), args.set, _workspace_path(args), args.cron, args.name)


@command("report")
@guard
def cmd_report(args: argparse.Namespace) -> int:
    from flows.views.report import write_report
    from storage.workspace import Workspace

    out = write_report(Workspace.open(args.workspace), args.run, Path(args.out) if args.out else None)
    _emit(args, {"report": str(out)}, str(out))
    return 0


@command("inspect")
@guard
def cmd_inspect(args: argparse.Namespace) -> int:
    from flows.views.inspect_render import (diff_page_path, inspect_page_path, print_diff, print_inspection,
                                            write_diff_html, write_inspection_html)
    from flows.views.inspection import diff_versions, inspect_run
    from storage.workspace import Workspace

    ws = Workspace.open(args.workspace)
    out_dir = ws.root / "reports" / args.run  # next to the run page, which links these pages
    run_page = None if args.out else "../run.html"
    if args.diff:
        diff = diff_versions(ws, args.run, args.diff[0], args.diff[1], step=args.step, top=args.top)
        if args.format == "text":
            print_diff(diff, tokens=args.tokens)
            return 0
        path = write_diff_html(diff, Path(args.out) if args.out else diff_page_path(out_dir, *args.diff), run_page)
    else:
        view = inspect_run(ws, args.run, reward=args.reward, step=args.step, top=args.top)
        if args.format == "text":
            print_inspection(view, tokens=args.tokens)
            return 0
        target = Path(args.out) if args.out else inspect_page_path(out_dir, args.reward or view.reward, args.step)
        path = write_inspection_html(view, target, run_page)
    _emit(args, {"page": str(path)}, str(path))
    return 0


@command("ui")
@guard
def cmd_ui(args: argparse.Namespace) -> int:
    from flows.views.ui import serve, ui_command
    from storage.settings import Settings

    cmd = ui_command(args.tool, Settings.from_env(args.workspace), host=args.host, port=args.port)
    if args.print:
        print(cmd.shell())
        return 0
    return serve(cmd)


@command("eval")
@guard
def cmd_eval(args: argparse.Namespace) -> int:
    from storage.settings import Settings
    from storage.sql import open_views

    con = open_views(Settings.from_env(args.workspace)).con
    policies = [args.policy_a, args.policy_b]
    rows = con.execute(
        "SELECT metric, policy_id, arg_max(value, created_at) AS value FROM evals WHERE policy_id IN (?, ?) "
        "GROUP BY ALL ORDER BY metric", policies).fetchall()
    table: dict[str, dict[str, float]] = {}
    for metric, pid, value in rows:
        table.setdefault(metric, {})[pid] = value
    if not table:
        print(f"error: no evals for {policies[0]} or {policies[1]}", file=sys.stderr)
        return 1
    print_rows(["metric"] + policies, [[m] + [v.get(p) for p in policies] for m, v in table.items()],
               "json" if args.json else "table")
    _print_comparison(args)
    return 0


def _print_comparison(args: argparse.Namespace) -> None:
    """The accuracy difference with its 95 % bootstrap interval over prompts (`stages.evaluate.compare`), or
    why there is none (evaluations without recorded rollouts, different metrics)."""
    from stages.evaluate import compare
    from storage.workspace import Workspace

    try:
        c = compare(Workspace.open(args.workspace), args.policy_a, args.policy_b)
    except ValueError as e:
        print(f"no paired comparison: {e}", file=sys.stderr)
        return
    if args.json:
        print(json.dumps({**c.__dict__, "difference": c.difference}))
        return
    print(f"accuracy {c.policy_b} - {c.policy_a}: {c.difference:+.3f} "
          f"(95 % interval {c.low:+.3f} to {c.high:+.3f}, bootstrap over {c.prompts} prompts; "
          f"{c.metric}, latest evaluation of each)")


@command("rewards")
@guard
def cmd_rewards(args: argparse.Namespace) -> int:
    from storage.settings import Settings
    from storage.sql import open_views

    con = open_views(Settings.from_env(args.workspace)).con
    rel = con.sql(
        "SELECT reward_name, reward_version, count(DISTINCT batch_id) AS batches, count(*) AS rows, "
        "count(*) FILTER (error IS NOT NULL) AS errors, count(*) FILTER (value IS NULL AND error IS NULL) AS not_applicable, "
        "round(avg(value), 4) AS mean, "
        "min(scored_at) AS first_scored, max(scored_at) AS last_scored, "
        "(SELECT string_agg(DISTINCT c.policy_id, ',') FROM checkpoints c "
        " WHERE c.trained_on->>'reward' = reward_name || '@' || reward_version) AS trained_policies "
        "FROM rewards GROUP BY ALL ORDER BY reward_name, last_scored")
    print_rows(rel.columns, [list(r) for r in rel.fetchall()], "json" if args.json else "table")
    return 0


def add_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    overrides = argparse.ArgumentParser(add_help=False, parents=[common])
    overrides.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                           help="override a config value, e.g. --set grpo.lr=5e-5 (repeatable)")
    cfg = argparse.ArgumentParser(add_help=False, parents=[overrides])
    cfg.add_argument("config", metavar="CONFIG", help="pipeline config (YAML)")

    p = sub.add_parser("run", parents=[cfg], help="run (or resume) the whole pipeline under Prefect")
    p.add_argument("--from", dest="fork_from", metavar="RUN@STEP", help="fork: start this run's lineage at a checkpoint "
                   "(RUN@STEP, RUN@latest or a checkpoint id), generating new rollouts; no SFT or first evaluation")

    p = sub.add_parser("night", parents=[cfg], help="one night of the deployment loop now: train on the traffic since "
                       "the last night from the champion, gate without labels, promote (what `rlops schedule` runs)")

    p = sub.add_parser("stage", parents=[overrides], help="run one stage and print its artifact id")
    p.add_argument("stage", choices=["sft", "rollout", "score", "grpo", "dpo", "rm", "evaluate"])
    p.add_argument("config", metavar="CONFIG", help="pipeline config (YAML)")
    p.add_argument("--policy", help="policy id (default/`base`: the config's base model)")
    p.add_argument("--rollouts", nargs="+", metavar="BATCH_ID", help="rollout batch ids (score, grpo, dpo)")
    p.add_argument("--reward", metavar="NAME[@VERSION]", help="reward to train on (grpo, dpo; default: latest version)")
    p.add_argument("--data", metavar="FILE", help="chat JSONL/Parquet (sft)")
    p.add_argument("--step", type=int, default=0, help="which prompts (rollout): step k takes the k-th slice")
    p.add_argument("--split", default="train", help="task split (rollout)")
    p.add_argument("--prefect", action="store_true", help="run as a Prefect flow (default: directly, no server start)")
    p.add_argument("--labels", action="store_true", help="dpo, rm: train on people's labels (`rlops review`): the `human` "
                   "reward on the labelled batches (or --rollouts), so a person's ordering of a group gives the pairs")
    p.add_argument("--reviewer", help="with --labels: only this reviewer's labels")

    p = sub.add_parser("rescore", parents=[cfg], help="rescore all stored rollouts of a run with the config's rewards")
    p.add_argument("--run", required=True, help="run name")

    p = sub.add_parser("retrain", parents=[cfg], help="replay a run's GRPO updates from a policy on rescored rollouts")
    p.add_argument("--from", dest="from_policy", required=True, metavar="POLICY")
    p.add_argument("--run", required=True, help="run whose rollouts are replayed")
    p.add_argument("--branch", help="name of the new lineage (default: RUN-retrain)")

    p = sub.add_parser("schedule", parents=[cfg], help="serve a Prefect deployment that retrains on a cron schedule")
    p.add_argument("--cron", required=True, help='cron expression, e.g. "0 3 * * *"')
    p.add_argument("--name", help="deployment name (default: the run name)")

    p = sub.add_parser("report", parents=[common], help="PNG curves + HTML summary of a run, logged to MLflow")
    p.add_argument("run", help="run name")
    p.add_argument("--out", help="output folder (default: WORKSPACE/reports/RUN)")

    p = sub.add_parser("inspect", parents=[common], help="a run's best and worst episodes per reward version, or a version diff")
    p.add_argument("run", help="run name")
    p.add_argument("--reward", metavar="NAME[@VERSION]", help="reward to rank by (default: the run's train reward; "
                   "every scored version unless one is given)")
    p.add_argument("--step", type=int, help="only the training batch of this GRPO step")
    p.add_argument("--top", type=int, default=5, help="episodes from each end (with --diff: how many changes)")
    p.add_argument("--diff", nargs=2, metavar=("REWARD@A", "REWARD@B"), help="the episodes whose score changed most from A to B")
    p.add_argument("--format", choices=["text", "html"], default="text",
                   help="text: the terminal; html: a static page under WORKSPACE/reports/RUN/inspect/ (path printed)")
    p.add_argument("--tokens", action="store_true", help="text: also print each token stream, sampled runs highlighted")
    p.add_argument("--out", help="html: write the page here instead")

    p = sub.add_parser("ui", parents=[common], help="open the Prefect or MLflow UI on this workspace's runs")
    p.add_argument("tool", choices=["prefect", "mlflow"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, help="default: 4200 (prefect), 5000 (mlflow)")
    p.add_argument("--print", action="store_true", help="print the command line (with its environment) instead of running it")

    p = sub.add_parser("eval", parents=[common], help="compare evaluations")
    p.add_argument("action", choices=["compare"])
    p.add_argument("policy_a")
    p.add_argument("policy_b")

    p = sub.add_parser("rewards", parents=[common], help="reward names, versions and where they were used")
    p.add_argument("action", choices=["ls"])
