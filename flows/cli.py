"""The `rlops` command line.

Heavy libraries (torch, transformers, ray, mlflow, prefect) are imported inside the commands
that need them, so `rlops --help`, `rlops sql` and `rlops ls` start fast. Commands that create
an artifact print its id as the last line of output (`--json` prints one JSON object instead).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flows.registry import COMMANDS, command, print_rows

# -- commands ----------------------------------------------------------------------------


@command("sql")
def cmd_sql(args: argparse.Namespace) -> int:
    import duckdb

    from storage.settings import Settings
    from storage.sql import QueryTimeout, RefusedStatement, Sandbox

    if bool(args.query) == bool(args.file):
        print("error: give a QUERY or -f FILE (one of them)", file=sys.stderr)
        return 2
    sql = Path(args.file).read_text() if args.file else args.query
    sandbox = Sandbox(Settings.from_env(args.workspace), timeout_s=args.timeout)
    sandbox.warn_skipped()
    try:
        table = sandbox.query(sql)
    except RefusedStatement as e:
        print(str(e), file=sys.stderr)
        return 2
    except QueryTimeout as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except duckdb.Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print_rows(table.column_names, [list(r.values()) for r in table.to_pylist()], args.format)
    return 0


@command("model")
def cmd_model(args: argparse.Namespace) -> int:
    from stages.policy.model import fingerprint, prepare_model

    try:
        path = prepare_model(args.source, args.name)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    digest = fingerprint(str(path))
    print(json.dumps({"model_dir": str(path), "fingerprint": digest}) if args.json else f"{path}\nfingerprint {digest}")
    return 0


LS_QUERIES = {
    "runs": "SELECT run_name, status, mlflow_run_id, started_at, finished_at FROM runs ORDER BY started_at",
    "checkpoints": "SELECT policy_id, parent_id, kind, step, run_name, trained_on, created_at FROM checkpoints ORDER BY created_at",
    "batches": "SELECT artifact_id, kind, stage, rows, inputs, completed_at FROM artifacts WHERE status = 'complete' ORDER BY completed_at",
}


@command("ls")
def cmd_ls(args: argparse.Namespace) -> int:
    from storage.settings import Settings
    from storage.sql import open_views

    views = open_views(Settings.from_env(args.workspace))
    table = views.con.sql(LS_QUERIES[args.what]).to_arrow_table()
    print_rows(table.column_names, [list(r.values()) for r in table.to_pylist()], "json" if args.json else "table")
    return 0


# -- parser ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--workspace", metavar="DIR", help="workspace folder (default: $RLOPS_WORKSPACE or ./rlops-workspace)")
    common.add_argument("--json", action="store_true", help="machine-readable output")

    parser = argparse.ArgumentParser(
        prog="rlops",
        description="Reinforcement fine-tuning of LLM agents as rerunnable stages (SFT, rollout, score, GRPO, evaluate).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("sql", parents=[common], help="read-only SQL over rollouts, rewards, evals and the catalog")
    p.add_argument("query", nargs="?", help="SQL text (SELECT only)")
    p.add_argument("-f", "--file", help="read the SQL from a file")
    p.add_argument("--format", choices=["table", "csv", "json"], default="table")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before the query is interrupted")

    p = sub.add_parser("model", parents=[common], help="manage base models")
    p.add_argument("action", choices=["prepare"], help="prepare: a model as a transformers folder (for a policy or a "
                   "judge), converted or downloaded once into the cache; prints its folder and fingerprint")
    p.add_argument("source", nargs="?", help="a .gguf file, a local folder or a hub id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--name", help="the cache folder's name for a converted or downloaded model (default: from SOURCE)")

    p = sub.add_parser("ls", parents=[common], help="list runs, checkpoints or artifact batches")
    p.add_argument("what", choices=sorted(LS_QUERIES))

    # register the pipeline, release, review and serving commands; import nothing heavy
    from flows import commands, release, review_commands, serve_commands

    commands.add_parsers(sub, common)
    release.add_parsers(sub, common)
    review_commands.add_parsers(sub, common)
    serve_commands.add_parsers(sub, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except BrokenPipeError:  # `rlops sql ... | head` closed the pipe: not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
