"""`rlops report RUN`: PNG curves and an HTML summary of one run, logged to its MLflow run.

  reward_by_step.png       mean training reward per GRPO step (the run's train reward)
  evals_by_checkpoint.png  every eval metric per evaluated checkpoint, in lineage order
  reward_distributions.png histogram of each reward version scored on the run's rollouts
  index.html               the three figures, the eval table and the lineage, linking:
  run.html                 the run page (flows/views/runpage.py): curves, held-out table, lineage, and
  inspect/*.html           the inspected episodes (flows/views/inspection.py) overall and per step
"""

from __future__ import annotations

import html
from pathlib import Path

from flows.views.inspection import train_reward
from flows.views.runpage import write_run_page
from storage.atomic import write_text_atomic
from storage.workspace import Workspace


def write_report(ws: Workspace, run_name: str, out: Path | None = None) -> Path:
    """Write the report folder for `run_name`; returns the path of index.html."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    run = ws.catalog.get_run(run_name)
    if run is None:
        raise KeyError(f"no run named {run_name!r} in this workspace (see `rlops ls runs`)")
    reward = train_reward(run["config"] or {})
    out = out or ws.root / "reports" / run_name
    out.mkdir(parents=True, exist_ok=True)

    batches_sql = ("SELECT DISTINCT s.artifact_id FROM stage_runs s JOIN artifacts a USING (artifact_id) "
                   "WHERE s.stage = 'rollout' AND s.run_name = $run AND a.meta->>'split' = 'train'")
    steps = ws.query(
        "SELECT CAST(a.meta->>'step' AS INTEGER) AS step, avg(w.value) AS mean, count(*) AS n FROM rewards w "
        f"JOIN artifacts a ON a.artifact_id = w.batch_id WHERE w.batch_id IN ({batches_sql}) "
        "AND w.reward_name = $reward GROUP BY 1 ORDER BY 1", {"run": run_name, "reward": reward}).to_pylist()
    evals = ws.query(
        "SELECT e.policy_id, coalesce(c.step, 0) AS step, c.kind, e.metric, e.value, e.created_at FROM evals e "
        "LEFT JOIN checkpoints c USING (policy_id) WHERE e.eval_batch_id IN "
        "(SELECT artifact_id FROM stage_runs WHERE stage = 'evaluate' AND run_name = $run) "
        "ORDER BY e.created_at", {"run": run_name}).to_pylist()
    dists = ws.query(
        "SELECT reward_name || '@' || reward_version AS version, list(value) AS values FROM rewards "
        f"WHERE batch_id IN ({batches_sql}) AND value IS NOT NULL GROUP BY 1 ORDER BY 1", {"run": run_name}).to_pylist()

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in steps], [r["mean"] for r in steps], marker="o")
    ax.set(xlabel="GRPO step", ylabel=f"mean {reward}", title=f"{run_name}: training reward by step")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "reward_by_step.png", dpi=100)
    plt.close(fig)

    policies = list(dict.fromkeys(r["policy_id"] for r in evals))
    metrics = sorted({r["metric"] for r in evals})
    fig, ax = plt.subplots(figsize=(7, 4))
    for m in metrics:
        values = {r["policy_id"]: r["value"] for r in evals if r["metric"] == m}
        ax.plot(range(len(policies)), [values.get(p) for p in policies], marker="o", label=m)
    ax.set_xticks(range(len(policies)), [p[:11] for p in policies], rotation=30, ha="right", fontsize=7)
    ax.set(ylabel="value", title=f"{run_name}: held-out metrics by checkpoint")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "evals_by_checkpoint.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for d in dists:
        ax.hist(d["values"], bins=20, alpha=0.5, label=d["version"])
    ax.set(xlabel="reward value", ylabel="rollouts", title=f"{run_name}: reward distributions per version")
    if dists:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "reward_distributions.png", dpi=100)
    plt.close(fig)

    rows = "".join(f"<tr><td>{html.escape(p)}</td>" + "".join(
        f"<td>{next((r['value'] for r in evals if r['policy_id'] == p and r['metric'] == m), float('nan')):.4f}</td>"
        for m in metrics) + "</tr>" for p in policies)
    lineage = "".join(f"<li>{html.escape(c['policy_id'])} ({c['kind']}, step {c['step']}) from "
                      f"{html.escape(str(c['parent_id']))}, trained on {html.escape(str(c['trained_on']))}</li>"
                      for c in ws.catalog.checkpoints(run_name))
    run_page = write_run_page(ws, run_name, out)
    pages = [(run_page.name, "run page: curves, held-out table, lineage")] + [
        (p.relative_to(out).as_posix(), f"inspected episodes: {p.stem}") for p in sorted((out / "inspect").glob("*.html"))]
    links = "".join(f"<li><a href='{html.escape(href)}'>{html.escape(text)}</a></li>" for href, text in pages)
    index = out / "index.html"
    write_text_atomic(index, 
        f"<!doctype html><html><head><meta charset='utf-8'><title>rlops report: {html.escape(run_name)}</title></head>"
        f"<body><h1>rlops report: {html.escape(run_name)}</h1><p>status: {run['status']}, MLflow run "
        f"{run['mlflow_run_id']}, train reward {html.escape(str(reward))}</p>"
        f"<img src='reward_by_step.png'><img src='evals_by_checkpoint.png'><img src='reward_distributions.png'>"
        f"<h2>Held-out evaluations</h2><table border='1'><tr><th>policy</th>"
        + "".join(f"<th>{html.escape(m)}</th>" for m in metrics) + f"</tr>{rows}</table>"
        f"<h2>Lineage</h2><ul>{lineage}</ul><h2>Pages</h2><ul class='pages'>{links}</ul></body></html>")
    if run["mlflow_run_id"]:
        for f in ("reward_by_step.png", "evals_by_checkpoint.png", "reward_distributions.png", "index.html", "run.html"):
            ws.tracker.log_artifact(run["mlflow_run_id"], out / f, "report")
        ws.tracker.log_artifact(run["mlflow_run_id"], out / "inspect", "report/inspect")
    return index
