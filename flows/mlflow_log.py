"""What a user expects to find in MLflow's UI: curves on the pipeline run, adapters as models.

    log_step(ws, parent_run_id, row, warm_started=True)    # each on_step row of flows.pipeline.train
    log_models(ws, parent_run_id, run_name, [final_policy])   # the adapter(s) as MLflow logged models

Each child run (one per stage execution) holds its own single point; the curves live on the
pipeline's parent run, one point per update step (GRPO, DPO or PPO) (`train/...`, and the judge's drift against the
programmatic rewards, `judge/...`, rewards/drift.py) and per evaluated checkpoint (`heldout/...`), keyed by the
checkpoint's step. The values come from the catalog (the checkpoint's
artifact metrics), not from the row, so the curves always mean what the checkpoint recorded. Points
are stamped with the checkpoint's creation time: a resumed run that replays cached steps logs
identical points, which MLflow keeps once.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from stages.checkpoints import UPDATE_KINDS
from storage.workspace import Workspace

# update checkpoint's artifact metric -> curve name on the parent run (grpo's, then dpo's and ppo's own)
TRAIN_CURVES = {
    "reward_mean": "train/reward_mean",
    "reward_std": "train/reward_std",
    "frac_zero_variance_groups": "train/zero_variance_share",
    "loss": "train/loss",
    "clip_frac": "train/clip_frac",
    "kl": "train/kl",  # only when grpo.beta > 0
    "tokens_per_s": "train/tokens_per_s",
    "grad_norm": "train/grad_norm",
    # off-policy health (stages/update/correction.py): 0 and 1.0 / 0 when generation and training agree
    "staleness": "train/staleness",
    "is_weight_mean": "train/is_weight_mean",
    "is_masked_frac": "train/is_masked_frac",
    # DPO (stages/dpo.py: TRL's figures at the last step): chosen preferred over rejected, and by how much
    "rewards_accuracies": "train/dpo_reward_accuracy",
    "rewards_margins": "train/dpo_reward_margin",
    "pairs": "train/dpo_pairs",
    # PPO (stages/ppo.py): the two halves of the loss and how much of the returns the critic explains
    "policy_loss": "train/policy_loss",
    "value_loss": "train/value_loss",
    "explained_variance": "train/explained_variance",
}
HELDOUT = "heldout/"
# With an SFT warm-start, step 0 of the held-out curves is the SFT checkpoint (where GRPO starts);
# the base model's evaluation, also at step 0, goes to its own keys instead of a second point there.
HELDOUT_BASE = "heldout_base/"
NOT_LOGGED = {"optimizer.pt"}  # training state for the next step, not part of the model
MAX_TAG = 5000  # MLflow caps tag values at 8000 characters


def _ms(ckpt: dict[str, Any]) -> int:
    return int(ckpt["created_at"].timestamp() * 1000)


def log_step(ws: Workspace, parent_run_id: str, row: dict[str, Any], warm_started: bool) -> None:
    """Log one on_step row's curves on the parent run: a GRPO step row (`step`, `policy`) or an
    evaluation row (`eval`: the policy id, then its held-out metrics)."""
    if "policy" in row:
        ckpt = ws.catalog.get_checkpoint(row["policy"])
        metrics = ws.catalog.get_artifact(row["policy"])["meta"]["metrics"]
        curves = {name: metrics[k] for k, name in TRAIN_CURVES.items() if k in metrics} | step_drift(ws, ckpt)
        ws.tracker.log_metrics(parent_run_id, curves, step=ckpt["step"], timestamp_ms=_ms(ckpt))
    elif "eval" in row:
        ckpt = ws.catalog.get_checkpoint(row["eval"])
        prefix = HELDOUT_BASE if ckpt["kind"] == "base" and warm_started else HELDOUT
        ws.tracker.log_metrics(parent_run_id, {prefix + k: v for k, v in row.items() if k != "eval"},
                               step=ckpt["step"], timestamp_ms=_ms(ckpt))


# The judge's drift on a step's own batch (its first: later ones are dynamic sampling's or replayed), from the newest
# scoring of that batch alone before the checkpoint was made (the step's, or a retrain's rescore).
STEP_DRIFT_SQL = """
SELECT judge, truth, agreement, tied_pairs, degenerate_groups FROM judge_drift
WHERE batches = [?] AND completed_at <= ?
QUALIFY row_number() OVER (PARTITION BY judge, truth ORDER BY completed_at DESC) = 1
"""


def step_drift(ws: Workspace, ckpt: dict[str, Any]) -> dict[str, float]:
    """The judge-drift curves (rewards/drift.py) of an update checkpoint's step; empty where its scoring watched no
    judge (no group reward, or no programmatic reward beside it)."""
    batches = (ckpt.get("trained_on") or {}).get("batches") or []
    if not batches:
        return {}
    return drift_curves(ws.query(STEP_DRIFT_SQL, [batches[0], ckpt["created_at"]]).to_pylist())


def drift_curves(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Drift rows (the `judge_drift` view's) as curves: `judge/{judge}.agreement.{truth}`, `.tied_pairs.`, and
    `judge/{judge}.degenerate_groups`; undefined measures (no pair to judge) are left out."""
    curves = {}
    for r in rows:
        for k in ("agreement", "tied_pairs"):
            if r.get(k) is not None:
                curves[f"judge/{r['judge']}.{k}.{r['truth']}"] = r[k]
        if r.get("degenerate_groups") is not None:
            curves[f"judge/{r['judge']}.degenerate_groups"] = r["degenerate_groups"]
    return curves


def lineage(ws: Workspace, policy_id: str) -> list[dict[str, Any]]:
    """The checkpoints from the base model to `policy_id`, in training order."""
    chain: list[dict[str, Any]] = []
    pid: str | None = policy_id
    while pid is not None:
        ckpt = ws.catalog.get_checkpoint(pid)
        if ckpt is None:
            raise KeyError(f"unknown policy {pid!r} in the lineage of {policy_id!r}")
        chain.append(ckpt)
        pid = ckpt["parent_id"]
    return chain[::-1]


def log_models(ws: Workspace, parent_run_id: str, run_name: str, policies: list[str], final: str | None = None) -> list[str]:
    """Log each policy's adapter (not the optimizer state) as an MLflow logged model, produced by the
    stage run that trained it and output by the pipeline run at its step, with lineage tags; return
    the model ids. A policy already logged is not logged twice; a base model (no adapter) is skipped.
    `final` also tags the pipeline run with its final model id."""
    from mlflow.entities import LoggedModelOutput

    client = ws.tracker.client
    ids = []
    for pid in policies:
        chain = lineage(ws, pid)
        ckpt = chain[-1]
        if ckpt["adapter_uri"] is None:
            continue
        model_id = logged_model_id(ws, pid)
        if model_id is None:
            model = client.create_logged_model(
                ws.tracker.experiment_id, name=_model_name(run_name, ckpt), source_run_id=ckpt["mlflow_run_id"],
                model_type="lora-adapter", tags=lineage_tags(run_name, chain),
                params={"base_model": ckpt["base_model"]})
            model_id = model.model_id
            for f in sorted(Path(ckpt["adapter_uri"]).iterdir()):
                if f.is_file() and f.name not in NOT_LOGGED:
                    client.log_model_artifact(model_id, str(f))
            client.finalize_logged_model(model_id, "READY")
        client.log_outputs(parent_run_id, [LoggedModelOutput(model_id, int(ckpt["step"]))])
        ids.append(model_id)
        if pid == final:
            ws.tracker.set_tags(parent_run_id, {"rlops.final_model_id": model_id})
    return ids


def logged_model_id(ws: Workspace, policy_id: str) -> str | None:
    """The id of the MLflow logged model holding `policy_id`'s adapter, or None when it is not logged yet."""
    if not re.fullmatch(r"[A-Za-z0-9_-]+", policy_id):  # it goes into a filter string, which takes no parameters
        raise ValueError(f"not a policy id: {policy_id!r}")
    found = ws.tracker.client.search_logged_models([ws.tracker.experiment_id],
                                                   filter_string=f"tags.`rlops.policy_id` = '{policy_id}'")
    return found[0].model_id if found else None


def _model_name(run_name: str, ckpt: dict[str, Any]) -> str:
    return f"{run_name}-{ckpt['kind']}" + (f"-step{ckpt['step']}" if ckpt["kind"] in UPDATE_KINDS else "")


def lineage_tags(run_name: str, chain: list[dict[str, Any]]) -> dict[str, str]:
    """A checkpoint's lineage as MLflow tags (its logged model's, its registered version's): the run, the chain
    of policies from the base, the reward name@version and rollout batches it was trained on, the base model
    with its content fingerprint, and the SFT data's hash."""
    ckpt = chain[-1]
    ids = [c["policy_id"] for c in chain]
    path = " -> ".join(ids)
    if len(path) > MAX_TAG:  # a long lineage: its start (base, SFT) and its most recent steps
        path = " -> ".join(ids[:2] + ["..."] + ids[-(MAX_TAG // (len(ids[-1]) + 4)) + 3:])
    sft = next((c["policy_id"] for c in chain if c["kind"] == "sft"), None)
    trained_on = ckpt["trained_on"] or {}
    tags = {"rlops.policy_id": ckpt["policy_id"], "rlops.parent_id": ckpt["parent_id"] or "",
            "rlops.kind": ckpt["kind"], "rlops.step": str(ckpt["step"]), "rlops.base_model": ckpt["base_model"],
            "rlops.run_name": run_name, "rlops.lineage": path, "rlops.sft_policy": sft or ""}
    if "reward" in trained_on:
        tags["rlops.reward"] = trained_on["reward"]
    if "batches" in trained_on:
        tags["rlops.trained_on_batches"] = ",".join(trained_on["batches"])[:MAX_TAG]
    base = (chain[0]["trained_on"] or {}) if chain[0]["kind"] == "base" else {}
    if base.get("fingerprint"):
        tags["rlops.base_fingerprint"] = base["fingerprint"]
    data_hash = next(((c["trained_on"] or {}).get("data_hash") for c in chain if c["kind"] == "sft"), None)
    if data_hash:
        tags["rlops.sft_data_hash"] = data_hash
    return tags
