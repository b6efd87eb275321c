"""The commands that take a trained policy to serving: `rlops promote`, `rlops rollback` and `rlops export`.

    rlops promote nightly --policy ck-... --reason "fixes the date bug"   # a person makes it the champion
    rlops rollback nightly --reason "answers got worse"                   # the previous champion back
    rlops export nightly@champion --format hf OUT                          # or gguf (a file), adapter

Each checks what it is given (the policy, the registered model, the base model's weights, the output path)
and says what is wrong before it writes anything. promote and rollback record their decision in the
catalog's `promotions` and on an MLflow run (flows/promotion.py) and print the new champion's policy id as the
last line; export prints the path it wrote.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flows.registry import command, guard

if TYPE_CHECKING:
    from storage.settings import Settings


def _checkpoint(settings: Settings, policy: str) -> dict[str, Any]:
    """The catalog row a policy reference names (stages/policy_ref.py), with a registry to read aliases from."""
    from stages.policy_ref import find_checkpoint
    from storage.registry import Registry

    return find_checkpoint(settings.snapshot_dir / "checkpoints.parquet", policy, Registry.reader(settings))


def describe(row: dict[str, Any]) -> str:
    """One line about a decision: which version is champion now, and why."""
    decided = f"{row['model_name']} version {row['challenger_version']} ({row['challenger']})"
    if row["promoted"]:
        return f"{decided} is the champion ({row['action']}): {row['reason']}"
    return (f"{decided} stays the challenger; version {row['champion_version']} ({row['champion']}) stays the "
            f"champion ({row['action']}): {row['reason']}")


def _print_decision(args: argparse.Namespace, row: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(row, default=str))
        return
    print(describe(row))
    print(row["challenger"] if row["promoted"] else row["champion"])


@command("promote")
@guard
def cmd_promote(args: argparse.Namespace) -> int:
    from storage.settings import Settings
    from storage.workspace import Workspace

    settings = Settings.from_env(args.workspace)
    row = _checkpoint(settings, args.policy)
    if row["adapter_uri"] is None:
        raise ValueError(f"{row['policy_id']} is a base model; a champion is a trained checkpoint")
    if not args.reason.strip():
        raise ValueError("--reason: say why (it is recorded with the decision)")
    from flows.promotion import promote

    _print_decision(args, promote(Workspace(settings), args.name, row["policy_id"], args.reason))
    return 0


@command("rollback")
@guard
def cmd_rollback(args: argparse.Namespace) -> int:
    from flows.promotion import rollback
    from storage.workspace import Workspace

    _print_decision(args, rollback(Workspace.open(args.workspace), args.name, args.reason))
    return 0


@command("export")
@guard
def cmd_export(args: argparse.Namespace) -> int:
    from stages.export import export, export_problems
    from storage.settings import Settings

    row = _checkpoint(Settings.from_env(args.workspace), args.policy)
    out = Path(args.out).expanduser().resolve()
    problems = export_problems(row, args.format, out, args.dtype)
    if problems:
        print(f"error: cannot export {args.policy}:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        return 2
    path = export(row, args.format, out, args.dtype)
    if args.json:
        print(json.dumps({"policy_id": row["policy_id"], "format": args.format, "dtype": args.dtype,
                          "path": str(path)}))
    else:
        print(f"exported {args.policy} ({row['policy_id']}) as {args.format}, {args.dtype}")
        print(path)
    return 0


def add_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    from stages.export import FORMATS, TORCH_DTYPES

    p = sub.add_parser("promote", parents=[common], help="make a policy the champion of a registered model (recorded)")
    p.add_argument("name", help="registered model (a gated run's promote.model_name, default its run name)")
    p.add_argument("--policy", required=True, help="a checkpoint id, RUN@latest, NAME@ALIAS or models:/NAME/VERSION")
    p.add_argument("--reason", required=True, help="why: recorded with the decision")

    p = sub.add_parser("rollback", parents=[common], help="give the champion alias back to the previous champion")
    p.add_argument("name", help="registered model")
    p.add_argument("--reason", default="rollback", help="why: recorded with the decision")

    p = sub.add_parser("export", parents=[common], help="write a policy for transformers/vLLM (hf), llama.cpp (gguf) "
                       "or vLLM's --lora-modules (adapter)")
    p.add_argument("policy", help="a checkpoint id, RUN@latest, NAME@champion or models:/NAME@ALIAS")
    p.add_argument("--format", choices=FORMATS, required=True, help="hf: merged folder; gguf: one file; adapter: peft")
    p.add_argument("out", help="the folder (hf, adapter) or .gguf file to write; must not exist")
    p.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="f32",
                   help="weights: f32 (as trained; exact), f16 (half the size), bf16 (hf only)")
