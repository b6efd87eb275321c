"""Arithmetic: a single-turn task with no tools, "What is 37 + 45?" -> 82.

The smallest task that still shows learning: a reward can check the number
exactly, and small models get some but not all of these right. Prompts are
generated from a seed, or read from a JSONL file of {"question", "answer"} rows
so that a scheduled retraining picks up rows appended to it.
"""

from __future__ import annotations

import hashlib
import json
import operator
import random
from pathlib import Path
from typing import Any

from tasks.base import Prompt, Task, write_chat_jsonl

SYSTEM_PROMPT = "Solve the arithmetic problem. Reply with the number only, no words or working."
OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
SPLITS = ("train", "test")


def make_task(
    digits: int = 2,
    operators: str = "+",
    n_train: int = 2000,
    n_test: int = 100,
    seed: int = 0,
    data_file: str | None = None,
) -> Task:
    """Build the arithmetic task.

    Generated prompts use operands with `digits` digits (2 -> 10..99) and operators drawn from
    `operators` (any of "+-*"); the same arguments always give the same prompts and the two
    splits never share a question. With `data_file`, its rows replace the generated prompts and
    `digits`, `operators`, `n_train`, `n_test` and `seed` are not used (see `load_rows`).
    """
    if data_file is not None:
        splits = load_rows(Path(data_file))
    else:
        splits = generate(digits, operators, n_train, n_test, seed)

    def prompts(split: str) -> list[Prompt]:
        if split not in splits:
            raise ValueError(f"arithmetic has splits {SPLITS}, not {split!r}")
        return list(splits[split])  # a copy: callers may shuffle or trim it

    return Task(name="arithmetic", system_prompt=SYSTEM_PROMPT, prompts=prompts, max_turns=1)


def write_oracle_dataset(path: str | Path, split: str = "train", n: int | None = None, **params: Any) -> int:
    """Write SFT demonstrations (system, question, the right number) for the first `n` prompts of
    `split` (None: all) as JSONL lines {"messages": [...], "tools": []}; returns the number of lines.
    `params` are the task's (`make_task`'s). They teach the answer format more than arithmetic."""
    task = make_task(**params)
    rows = (
        {"messages": task.messages(p) + [{"role": "assistant", "content": str(p.metadata["answer"])}], "tools": []}
        for p in task.prompts(split)[:n]
    )
    return write_chat_jsonl(path, rows)


def prompt_id(question: str) -> str:
    """A stable id from the question text alone, so it survives reordering, resizing and appends."""
    return "arith-" + hashlib.sha1(question.encode()).hexdigest()[:12]


def generate(digits: int, operators: str, n_train: int, n_test: int, seed: int) -> dict[str, list[Prompt]]:
    """`n_train` + `n_test` distinct random problems, split into train and test."""
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    if not operators or set(operators) - set(OPERATORS):
        raise ValueError(f"operators must be a non-empty string of {''.join(OPERATORS)!r}, got {operators!r}")
    ops = sorted(set(operators), key="+-*".index)  # "+*" and "*+" give the same prompts
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    m = hi - lo + 1
    # Ordered pairs for + and *; for - only pairs with a >= b, since the operands are swapped below.
    space = sum(m * (m + 1) // 2 if op == "-" else m * m for op in ops)
    if n_train + n_test > space:
        raise ValueError(f"only {space} distinct problems with digits={digits}, operators={operators!r}")

    rng = random.Random(seed)
    seen: set[str] = set()
    drawn: list[Prompt] = []
    while len(drawn) < n_train + n_test:
        op = rng.choice(ops)
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if op == "-" and b > a:
            a, b = b, a  # keep answers non-negative, so a reward never hinges on reading a minus sign
        expression = f"{a} {op} {b}"
        if expression in seen:
            continue  # a question in both splits would leak test answers into training
        seen.add(expression)
        question = f"What is {expression}?"
        metadata = {"answer": OPERATORS[op](a, b), "expression": expression}
        drawn.append(Prompt(prompt_id(question), question, metadata))
    # Test is drawn first so that changing n_train leaves the test split unchanged.
    return {"test": drawn[:n_test], "train": drawn[n_test:]}


def load_rows(path: Path) -> dict[str, list[Prompt]]:
    """Prompts from a JSONL file of {"question", "answer"} rows (an optional "split" is respected).

    A row without "split" goes to test when its question hashes into one bucket of ten, so a
    row keeps its split and its id as rows are appended. A repeated question keeps its first row.
    """
    splits: dict[str, list[Prompt]] = {s: [] for s in SPLITS}
    seen: set[str] = set()
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row: dict[str, Any] = json.loads(line)
        question = str(row["question"])
        if question in seen:
            continue
        seen.add(question)
        pid = prompt_id(question)
        split = row.get("split") or ("test" if int(pid[-12:], 16) % 10 == 0 else "train")
        if split not in splits:
            raise ValueError(f"{path}:{line_no}: split must be one of {SPLITS}, got {split!r}")
        metadata: dict[str, Any] = {"answer": int(row["answer"])}
        if "expression" in row:
            metadata["expression"] = row["expression"]
        splits[split].append(Prompt(pid, question, metadata))
    return splits
