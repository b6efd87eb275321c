"""On-policy distillation (`grpo.distill`): a teacher's per-token log-probs on the student's own samples.

    rows = read_scored(ws, batches, reward)
    attach_teacher_logprobs(ws, Distill(teacher="ck-..."), rows, temperature)   # rows gain "teacher_logprobs"

The student samples, the teacher scores every sampled token, and each token's advantage gains
coef x (log p_teacher - log p_behaviour): minus the per-token reverse KL estimate, so the student moves toward
what the teacher would have said in the states the student itself reaches (the on-policy distillation of Agarwal
et al., GKD, arXiv 2306.13649, as TRL's GKDTrainer and Thinking Machines' "On-Policy Distillation" describe it).
Beside a task reward it adds to GRPO's sequence advantage; without signal it is the whole of it.

The teacher is a checkpoint of this workspace (self-distillation from a stronger adapter of any run) or a model
(name or folder) with the student's tokenizer. Its log-probs are computed once per rollout batch and stored in
the workspace (`distill/<teacher key>/<batch>.parquet`, written whole or not at all), so a rerun, a retrain or a
second epoch reads them instead of running the teacher again. The teacher's identity (`teacher_key`: a checkpoint
id, or a model's content fingerprint) is part of the update's id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.update.config import Distill
from storage.workspace import Workspace

_TEACHERS: dict[str, Any] = {}  # teacher key -> the loaded model (one process keeps its teacher between steps)


def teacher_key(ws: Workspace, teacher: str) -> str:
    """What names the teacher's log-probs: its checkpoint id, or `model-<content fingerprint>` of a model folder
    (the name itself for a hub id that is not a local folder)."""
    if ws.catalog.get_checkpoint(teacher) is not None:
        return teacher
    from stages.policy.model import fingerprint

    found = fingerprint(teacher)
    return f"model-{found}" if found else "model-" + "".join(c if c.isalnum() else "-" for c in teacher)


def _load_teacher(ws: Workspace, teacher: str, key: str) -> Any:
    """The teacher in eval mode, fp32 on the training device (a checkpoint: its base model with its adapter)."""
    if key in _TEACHERS:
        return _TEACHERS[key]
    import torch

    from stages.update.train import load_base

    device = "cuda" if torch.cuda.is_available() else "cpu"
    row = ws.catalog.get_checkpoint(teacher)
    if row is None:
        model = load_base(teacher, device)
    else:
        from peft import PeftModel

        from storage.checkpoints import local_copy

        model = load_base(row["base_model"], device)
        if row["adapter_uri"]:
            model = PeftModel.from_pretrained(model, local_copy(row["adapter_uri"]))
    _TEACHERS.clear()  # one teacher at a time
    _TEACHERS[key] = model.eval()
    return _TEACHERS[key]


def _compute(model: Any, rows: list[dict[str, Any]], temperature: float, size: int = 8) -> dict[str, list[float]]:
    """rollout_id -> the teacher's log-prob of each token (0 where the policy did not sample), segment by segment."""
    import torch

    from stages.policy.logprobs import token_logprobs
    from storage.schema import segment_bounds

    pieces = [(r["rollout_id"], a, b, r["token_ids"][a:b], r["loss_mask"][a:b]) for r in rows
              for a, b in segment_bounds(r.get("segment_starts"), len(r["token_ids"])) if any(r["loss_mask"][a:b])]
    out = {r["rollout_id"]: [0.0] * len(r["token_ids"]) for r in rows}
    vocab = model.get_output_embeddings().weight.shape[0]
    top = max((max(p[3]) for p in pieces), default=-1)
    if top >= vocab:
        raise ValueError(f"grpo.distill.teacher has a vocabulary of {vocab} tokens but the student sampled token id {top}: "
                         "the teacher needs the student's tokenizer")
    device = next(model.parameters()).device
    pieces.sort(key=lambda p: len(p[3]))
    with torch.no_grad():
        for start in range(0, len(pieces), size):
            chunk = pieces[start:start + size]
            T = max(len(p[3]) for p in chunk)
            ids, attn, mask = (torch.zeros(len(chunk), T, dtype=torch.long) for _ in range(3))
            for i, (_, _, _, tokens, loss_mask) in enumerate(chunk):
                ids[i, :len(tokens)], attn[i, :len(tokens)] = torch.tensor(tokens), 1
                mask[i, :len(tokens)] = torch.tensor(loss_mask)
            logp = token_logprobs(model, ids.to(device), attn.to(device), mask.to(device), temperature).cpu()
            for i, (rid, a, b, tokens, _) in enumerate(chunk):
                out[rid][a:b] = logp[i, :len(tokens)].tolist()
    return out


def attach_teacher_logprobs(ws: Workspace, distill: Distill, rows: list[dict[str, Any]], temperature: float) -> str:
    """Give every row its `teacher_logprobs` (aligned with its tokens), read from the workspace where a batch's were
    stored, else computed by the teacher and stored; returns the teacher key."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    key = teacher_key(ws, distill.teacher)
    folder = ws.root / "distill" / key
    by_batch: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_batch.setdefault(r["batch_id"], []).append(r)
    found: dict[str, list[float]] = {}
    for batch, batch_rows in by_batch.items():
        path = folder / f"{batch}-t{temperature:g}.parquet"
        if path.exists():
            table = pq.read_table(path).to_pylist()
            found.update({t["rollout_id"]: t["teacher_logprobs"] for t in table})
        if any(r["rollout_id"] not in found for r in batch_rows):
            computed = _compute(_load_teacher(ws, distill.teacher, key), batch_rows, temperature)
            _write_atomic(path, pa.table({"rollout_id": list(computed), "teacher_logprobs": list(computed.values())}))
            found.update(computed)
    for r in rows:
        r["teacher_logprobs"] = found[r["rollout_id"]]
    return key


def _write_atomic(path: Path, table: Any) -> None:
    import os

    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
