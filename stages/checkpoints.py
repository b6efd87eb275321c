"""The one checkpoint writer: where a checkpoint's files go, how they appear, how it is registered.

    path = write_checkpoint(ctx, Checkpoint(policy_id, parent_id=..., base_model=..., kind="grpo", step=3,
                                            trained_on={...}, config_hash=..., mlflow_run_id=...),
                            save=lambda folder: model.save_pretrained(folder))

`save` fills a temporary folder next to `<checkpoints>/<policy_id>`; the folder is renamed onto the
final path only when `save` returns (storage.atomic.atomic_dir: stale temps of killed runs are
removed, a complete folder already there is replaced whole), and only then is the checkpoint
registered in the catalog with its lineage. So a crash leaves a whole checkpoint or none, and the
catalog never points at a half-written folder. A failed write (a full disk, a file-size limit) raises
`WriteError` naming the checkpoint's folder, whatever the serializer's own error type.

An update stage (grpo, dpo, ppo) writes through `write_update`, which decides the step, the lineage
and the config hash of a checkpoint trained from a parent on scored batches, and the fields every
update's `trainer_state.json` starts with.
"""

from __future__ import annotations

import errno
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from stages.common import StageContext, identity
from storage.atomic import WriteError, atomic_dir
from storage.checkpoints import publish
from storage.ids import config_hash
from storage.workspace import Workspace

# The checkpoint kinds a pipeline step's update writes (the `algorithm:`, flows/algorithms.py: grpo, rloo and
# reinforce_pp write `grpo`): the run page's step chain and curves, `rlops inspect`'s steps and MLflow's curves.
UPDATE_KINDS = ("grpo", "dpo", "ppo")


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint's catalog row (the `checkpoints` table), less what the writer fills in."""

    policy_id: str
    parent_id: str
    base_model: str
    kind: str  # sft | grpo | dpo | ppo
    step: int
    config_hash: str
    mlflow_run_id: str | None = None
    trained_on: dict[str, Any] = field(default_factory=dict)  # data hash, or rollout batches + reward name@version


def checkpoint_path(ws: Workspace, policy_id: str) -> Path:
    """Where a checkpoint's adapter folder lives."""
    return ws.settings.checkpoints_dir / policy_id


def write_checkpoint(ctx: StageContext, checkpoint: Checkpoint, save: Callable[[Path], None]) -> Path:
    """Write the checkpoint's folder atomically with `save(folder)`, then register it; returns its path."""
    final = checkpoint_path(ctx.ws, checkpoint.policy_id)
    try:
        with atomic_dir(final) as tmp:
            save(tmp)
    except WriteError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors and torch.save report a full disk in their own types, without the path
        raise WriteError(errno.EIO, f"cannot write {final}: {e}") from e
    # With an object-store data root the folder is uploaded (completion marker last) and registered by its URI.
    ctx.ws.catalog.add_checkpoint({**asdict(checkpoint), "adapter_uri": publish(ctx.ws.settings, final),
                                   "run_name": ctx.run_name})
    return final


def write_update(ctx: StageContext, *, kind: str, policy_id: str, parent_id: str, base_model: str, batches: list[str],
                 reward: Any, config: Any, mlflow_run_id: str, state: dict[str, Any],
                 save: Callable[[Path, dict[str, Any]], None]) -> Path:
    """Write the checkpoint of one update of `parent_id` on `batches` scored by `reward` (a resolved RewardRef).

    Its step is the parent's + 1, its lineage the batches and the reward name@version, its hash the
    config's identity. `save(folder, state)` writes the files, `state` being the trainer state: the
    checkpoint's id, parent, step, lineage and config, then the stage's own `state` fields.
    """
    step = ctx.ws.catalog.get_checkpoint(parent_id)["step"] + 1
    trained_on = {"batches": batches, "reward": str(reward)}
    full_state = {"policy_id": policy_id, "parent_id": parent_id, "step": step, "trained_on": trained_on,
                  "config": identity(config), **state}
    checkpoint = Checkpoint(policy_id, parent_id=parent_id, base_model=base_model, kind=kind, step=step,
                            config_hash=config_hash(identity(config)), mlflow_run_id=mlflow_run_id, trained_on=trained_on)
    return write_checkpoint(ctx, checkpoint, save=lambda folder: save(folder, full_state))
