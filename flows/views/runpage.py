"""The run page: one static HTML file per run, opened from disk, nothing served.

    path = write_run_page(ws, "arithmetic-demo")     # WORKSPACE/reports/<run>/run.html

It answers "did this run learn, and on what?": training curves per update step, whatever the run's
`algorithm:` (GRPO: reward mean with its std band, zero-variance share, loss, clip fraction, KL,
tokens/s; DPO: loss, reward accuracy and margin; PPO: policy and value loss, explained variance), the
held-out metrics by checkpoint (a curve and a table), the lineage (base -> SFT -> each step, and the retrain
branches replayed from this run), each reward's agreement with the labels people gave the run's episodes
(`rlops review`), and links to the inspected episodes: the run's best and worst episodes overall and at each step,
and any version diffs written for it. Everything is read from
the catalog and the Parquet views, the source of truth (MLflow holds the same curves).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flows.views.agreement import agreement, agreement_html
from flows.views.inspect_render import inspect_page_path, write_inspection_html
from flows.views.inspection import inspect_run, read_views, run_batches, train_reward
from flows.views.pages import esc, fmt, line_chart, write_page
from stages.checkpoints import UPDATE_KINDS
from storage.workspace import Workspace

# update checkpoint's artifact metric -> chart title; the ones a reader checks first, in that order. A chart
# appears when some step recorded its metric: GRPO's, DPO's (TRL's last-step figures) or PPO's.
CHARTS = [("frac_zero_variance_groups", "zero-variance share (no signal)"), ("loss", "loss"),
          ("clip_frac", "clip fraction"), ("kl", "KL to the base"),
          ("rewards_accuracies", "DPO reward accuracy (chosen above rejected)"), ("rewards_margins", "DPO reward margin"),
          ("policy_loss", "PPO policy loss"), ("value_loss", "PPO value loss"),
          ("explained_variance", "PPO critic's explained variance"), ("tokens_per_s", "training tokens/s")]


def write_run_page(ws: Workspace, run: str, out_dir: Path | None = None, top: int = 3) -> Path:
    """Write `run.html` and the inspect pages it links to (the train reward, all steps and each step)
    into `out_dir` (default WORKSPACE/reports/RUN); return the run page's path."""
    row = ws.catalog.get_run(run)
    if row is None:
        raise KeyError(f"no run named {run!r} in this workspace (see `rlops ls runs`)")
    out_dir = out_dir or ws.root / "reports" / run
    config = row["config"] or {}
    reward = train_reward(config)
    try:
        batches = run_batches(ws, run)
    except KeyError:  # a run without GRPO steps (steps: 0) has no training episodes to inspect
        batches = {}
    steps = sorted({s for s in batches.values() if s is not None})

    links = []
    if reward is not None and batches:
        overall = write_inspection_html(inspect_run(ws, run, reward, top=top), inspect_page_path(out_dir, reward, None))
        links.append((f"all steps: the {top} best and worst episodes per version of {reward}", overall))
        for step in steps:
            page = write_inspection_html(inspect_run(ws, run, reward, step=step, top=top),
                                         inspect_page_path(out_dir, reward, step))
            links.append((f"step {step}", page))
    diffs = sorted((out_dir / "inspect").glob("diff-*.html"))

    evals = _evals(ws, run)
    chain, branches = _lineage(ws, run, evals)
    body = [f"<h1>Run {esc(run)}</h1>",
            f"<p class='meta'>status {esc(row['status'])} · started {esc(row['started_at'])} · finished "
            f"{esc(row['finished_at'])} · train reward {esc(reward)} · task {esc((config.get('task') or {}).get('name'))} · "
            f"base model {esc(config.get('base_model'))} · MLflow run {esc(row['mlflow_run_id'])}</p>",
            "<nav>" + "".join(f"<a href='#{a}'>{t}</a>" for a, t in (
                ("curves", "curves"), ("heldout", "held-out"), ("lineage", "lineage"), ("labels", "labels"),
                ("episodes", "episodes"))) + "</nav>",
            "<h2 id='curves'>Training curves</h2>", _curves(ws, chain, evals),
            "<h2 id='heldout'>Held-out evaluations by checkpoint</h2>", _eval_table(chain, evals),
            "<h2 id='lineage'>Lineage</h2>", _lineage_html(chain, branches),
            "<h2 id='labels'>Rewards against people's labels</h2>", _agreement(ws, run),
            "<h2 id='episodes'>Inspected episodes</h2><ul class='inspect-links'>"
            + "".join(f"<li><a href='{esc(p.relative_to(out_dir).as_posix())}'>{esc(t)}</a></li>" for t, p in links)
            + "".join(f"<li><a href='{esc(p.relative_to(out_dir).as_posix())}'>version diff: {esc(p.stem[5:])}</a></li>"
                      for p in diffs) + "</ul>"]
    return write_page(out_dir / "run.html", f"rlops run {run}", "".join(body))


def _agreement(ws: Workspace, run: str) -> str:
    """Each reward's agreement with the labels people gave the run's episodes (`rlops review agreement`)."""
    try:
        return agreement_html(agreement(ws, run))
    except KeyError:  # a run that generated no episodes
        return "<p class='meta'>This run has no episodes to label.</p>"


def _lineage(ws: Workspace, run: str, evals: dict[str, dict[str, float]]
             ) -> tuple[list[dict[str, Any]], list[tuple[str, list[dict[str, Any]]]]]:
    """(the run's checkpoints from the base model on, [(retrain branch name, its checkpoints)])."""
    own = ws.catalog.checkpoints(run)
    chain = []
    if own:  # the run's first checkpoint descends from the base model (or a lineage it continues)
        pid = own[0]["parent_id"]
        while pid is not None:
            ckpt = ws.catalog.get_checkpoint(pid)
            chain.insert(0, ckpt)
            pid = ckpt["parent_id"]
    else:  # nothing trained (steps: 0, no SFT): the policies it evaluated, i.e. the base model
        chain = [c for p in evals if (c := ws.catalog.get_checkpoint(p)) is not None]
    branches = [(r["run_name"], ws.catalog.checkpoints(r["run_name"])) for r in ws.catalog.runs()
                if (r["config"] or {}).get("retrain_of") == run]
    return chain + own, branches


def _evals(ws: Workspace, run: str) -> dict[str, dict[str, float]]:
    """policy id -> held-out metric -> value (the latest evaluation) for the policies this run evaluated."""
    with read_views(ws) as con:
        rows = con.execute(
            "SELECT policy_id, metric, arg_max(value, created_at) FROM evals WHERE eval_batch_id IN "
            "(SELECT artifact_id FROM stage_runs WHERE stage = 'evaluate' AND run_name = ?) GROUP BY ALL", [run]).fetchall()
    out: dict[str, dict[str, float]] = {}
    for pid, metric, value in rows:
        out.setdefault(pid, {})[metric] = value
    return out


def _curves(ws: Workspace, chain: list[dict[str, Any]], evals: dict[str, dict[str, float]]) -> str:
    steps = [(c["step"], ws.catalog.get_artifact(c["policy_id"])["meta"]["metrics"]) for c in chain
             if c["kind"] in UPDATE_KINDS]
    # GRPO's own charts stay on a GRPO run's page even when no step recorded them (all groups without signal).
    grpo_run = any(c["kind"] == "grpo" for c in chain)
    shown = {"frac_zero_variance_groups", "loss", "clip_frac", "tokens_per_s"} if grpo_run else set()
    charts = [line_chart("train reward (mean ± std)", {"reward_mean": [(s, m["reward_mean"]) for s, m in steps if "reward_mean" in m]},
                         band={"reward_mean": [(s, m["reward_mean"] - m["reward_std"], m["reward_mean"] + m["reward_std"])
                                               for s, m in steps if "reward_std" in m]})]
    # A step whose groups all had zero variance trained nothing and has no loss: its point is missing. A chart
    # no step recorded (KL without beta > 0, another algorithm's metric) is left out.
    charts += [line_chart(title, {key: [(s, m[key]) for s, m in steps if key in m]}) for key, title in CHARTS
               if key in shown or any(key in m for _, m in steps)]
    # Held-out by step: the policy the updates start from (SFT, else base) at step 0, then each step's checkpoint.
    start = next((c for c in reversed(chain) if c["kind"] not in UPDATE_KINDS), None)
    evaluated = [c for c in chain if c["policy_id"] in evals and (c["kind"] in UPDATE_KINDS or c is start)]
    metrics = sorted({m for c in evaluated for m in evals[c["policy_id"]]})
    charts.append(line_chart("held-out metrics by step", {m: [(c["step"], evals[c["policy_id"]][m]) for c in evaluated
                                                              if m in evals[c["policy_id"]]] for m in metrics}))
    return f"<div class='charts'>{''.join(charts)}</div>"


def _eval_table(chain: list[dict[str, Any]], evals: dict[str, dict[str, float]]) -> str:
    rows = [c for c in chain if c["policy_id"] in evals]
    if not rows:
        return "<p>No held-out evaluations recorded for this run.</p>"
    metrics = sorted({m for c in rows for m in evals[c["policy_id"]]})
    head = "".join(f"<th>{esc(m)}</th>" for m in metrics)
    body = "".join(f"<tr data-policy-id='{esc(c['policy_id'])}'><td>{esc(c['policy_id'])}</td><td>{esc(c['kind'])}</td>"
                   f"<td class='num'>{esc(c['step'])}</td>"
                   + "".join(f"<td class='num'>{fmt(evals[c['policy_id']].get(m))}</td>" for m in metrics) + "</tr>"
                   for c in rows)
    return f"<table class='heldout'><tr><th>checkpoint</th><th>kind</th><th>step</th>{head}</tr>{body}</table>"


def _ckpt_html(c: dict[str, Any]) -> str:
    trained = c["trained_on"] or {}
    what = (f"reward {esc(trained['reward'])} on {len(trained.get('batches', []))} batch(es)" if "reward" in trained
            else f"data {esc(Path(trained['data']).name)}" if "data" in trained else "")
    return (f"<li data-policy-id='{esc(c['policy_id'])}'><b>{esc(c['kind'])}</b> step {esc(c['step'])}: "
            f"<code>{esc(c['policy_id'])}</code> {what}</li>")


def _lineage_html(chain: list[dict[str, Any]], branches: list[tuple[str, list[dict[str, Any]]]]) -> str:
    out = ["<ol class='lineage'>", *map(_ckpt_html, chain), "</ol>"]
    for name, ckpts in branches:
        origin = esc(ckpts[0]["parent_id"]) if ckpts else "?"
        out.append(f"<h3>retrain branch {esc(name)} (from <code>{origin}</code>)</h3><ol class='branch'>"
                   + "".join(map(_ckpt_html, ckpts)) + "</ol>")
    return "".join(out)
