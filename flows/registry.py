"""The command registry and table printing shared by `flows.cli` and `flows.commands`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def command(name: str) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    def wrap(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = fn
        return fn

    return wrap


def guarded(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A command whose config errors exit 2 and whose unknown names or bad values (KeyError, ValueError) exit 1,
    each as one `error: ...` line."""
    from flows.config import ConfigError

    def wrapped(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except (KeyError, ValueError) as e:
            print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
            return 1

    wrapped.__name__ = fn.__name__
    return wrapped


# -- output ------------------------------------------------------------------------------


def _cell(v: Any) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def print_rows(columns: list[str], rows: list[list[Any]], fmt: str = "table", out=None) -> None:
    """Print rows as an aligned text table, CSV or JSON lines."""
    out = out or sys.stdout
    if fmt == "json":
        for row in rows:
            out.write(json.dumps(dict(zip(columns, row)), default=str) + "\n")
    elif fmt == "csv":
        import csv

        w = csv.writer(out, lineterminator="\n")  # the csv default is \r\n; shells keep the \r in $(...)
        w.writerow(columns)
        w.writerows([["" if v is None else v for v in r] for r in rows])
    else:
        cells = [[_cell(v) for v in r] for r in rows]
        widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
        out.write("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip() + "\n")
        out.write("  ".join("-" * w for w in widths) + "\n")
        for r in cells:
            out.write("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")
        out.write(f"({len(rows)} row{'s' if len(rows) != 1 else ''})\n")


