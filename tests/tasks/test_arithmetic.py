"""The arithmetic task: deterministic, disjoint splits, correct answers, stable ids from a data file."""

from __future__ import annotations

import json
import operator
import re
from pathlib import Path

import pytest

from tasks.arithmetic import make_task, prompt_id, write_oracle_dataset
from tasks.base import Prompt

EXPRESSION = re.compile(r"^(\d+) ([+\-*]) (\d+)$")
APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def all_prompts(**params: object) -> dict[str, list[Prompt]]:
    task = make_task(**params)  # type: ignore[arg-type]
    return {s: task.prompts(s) for s in ("train", "test")}


def test_same_seed_same_prompts_other_seed_other_prompts() -> None:
    a, b = all_prompts(seed=3, n_train=50, n_test=10), all_prompts(seed=3, n_train=50, n_test=10)
    assert a == b
    assert all_prompts(seed=4, n_train=50, n_test=10)["train"] != a["train"]


def test_splits_have_their_sizes_and_share_no_question() -> None:
    splits = all_prompts(operators="+-*", n_train=2000, n_test=100)
    assert (len(splits["train"]), len(splits["test"])) == (2000, 100)
    train_q = {p.question for p in splits["train"]}
    test_q = {p.question for p in splits["test"]}
    assert len(train_q) == 2000 and len(test_q) == 100 and not train_q & test_q
    ids = [p.prompt_id for s in splits.values() for p in s]
    assert len(set(ids)) == len(ids)


def test_test_split_does_not_move_when_n_train_changes() -> None:
    assert all_prompts(n_train=10, n_test=20)["test"] == all_prompts(n_train=500, n_test=20)["test"]


@pytest.mark.parametrize("op", ["+", "-", "*"])
@pytest.mark.parametrize("digits,lo,hi", [(1, 1, 9), (2, 10, 99), (3, 100, 999)])
def test_answers_are_correct_for_each_operator(op: str, digits: int, lo: int, hi: int) -> None:
    for p in all_prompts(digits=digits, operators=op, n_train=30, n_test=10)["train"]:
        a, got_op, b = EXPRESSION.match(p.metadata["expression"]).groups()  # type: ignore[union-attr]
        assert got_op == op and lo <= int(a) <= hi and lo <= int(b) <= hi
        assert p.question == f"What is {p.metadata['expression']}?"
        assert isinstance(p.metadata["answer"], int)
        assert p.metadata["answer"] == APPLY[op](int(a), int(b)) >= 0
        assert p.prompt_id == prompt_id(p.question)


def test_mixed_operators_use_every_operator() -> None:
    ops = {p.metadata["expression"].split()[1] for p in all_prompts(operators="*-+", n_train=200)["train"]}
    assert ops == {"+", "-", "*"}


def test_task_shape() -> None:
    task = make_task(n_train=5, n_test=5)
    assert (task.name, task.max_turns, task.tools, task.tool_specs) == ("arithmetic", 1, {}, [])
    assert task.messages(task.prompts("test")[0])[0] == {"role": "system", "content": task.system_prompt}


@pytest.mark.parametrize(
    "params,message",
    [
        ({"operators": "/"}, "operators"),
        ({"operators": ""}, "operators"),
        ({"digits": 0}, "digits"),
        ({"digits": 1, "n_train": 80, "n_test": 10}, "distinct problems"),  # only 81 sums of two 1-digit numbers
        ({"digits": 1, "operators": "-", "n_train": 40, "n_test": 6}, "distinct"),  # 45 non-negative differences
    ],
)
def test_bad_parameters_are_refused(params: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_task(**params)  # type: ignore[arg-type]


def test_the_whole_problem_space_can_be_drawn() -> None:
    splits = all_prompts(digits=1, operators="-", n_train=40, n_test=5)
    assert len({p.question for s in splits.values() for p in s}) == 45


def test_unknown_split_is_refused() -> None:
    with pytest.raises(ValueError, match="splits"):
        make_task(n_train=1, n_test=1).prompts("validation")


def write_rows(path: Path, rows: list[dict[str, object]], mode: str = "w") -> None:
    with path.open(mode) as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_data_file_replaces_generated_prompts_and_keeps_ids_when_rows_are_appended(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    first = [{"question": f"What is {i} + {i}?", "answer": 2 * i} for i in range(40)]
    write_rows(path, first)
    before = all_prompts(data_file=str(path))
    assert sum(len(s) for s in before.values()) == 40
    assert before["test"], "about one row in ten goes to test"

    write_rows(path, [{"question": f"What is {i} * 3?", "answer": str(3 * i)} for i in range(40)], mode="a")
    after = all_prompts(data_file=str(path))
    for split in ("train", "test"):
        # The old rows keep their ids, their split and their order; the new ones come after them.
        assert after[split][: len(before[split])] == before[split]
    new = [p for s in after.values() for p in s if "*" in p.question]
    assert len(new) == 40 and all(isinstance(p.metadata["answer"], int) for p in new)
    by_question = {p.question: p for s in after.values() for p in s}
    assert by_question["What is 7 + 7?"].prompt_id == prompt_id("What is 7 + 7?")
    assert by_question["What is 7 + 7?"].metadata == {"answer": 14}


def test_data_file_respects_split_and_drops_repeated_questions(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"question": "What is 1 + 1?", "answer": 2, "split": "test", "expression": "1 + 1"},
        {"question": "What is 2 + 2?", "answer": 4, "split": "train"},
        {"question": "What is 1 + 1?", "answer": 2, "split": "train"},  # a repeat: ignored
    ]
    write_rows(path, rows)
    splits = all_prompts(data_file=str(path))
    assert [p.question for p in splits["test"]] == ["What is 1 + 1?"]
    assert [p.question for p in splits["train"]] == ["What is 2 + 2?"]
    assert splits["test"][0].metadata == {"answer": 2, "expression": "1 + 1"}


def test_generated_and_file_prompts_share_ids(tmp_path: Path) -> None:
    generated = make_task(n_train=3, n_test=0).prompts("train")
    path = tmp_path / "prompts.jsonl"
    write_rows(path, [{"question": p.question, "answer": p.metadata["answer"], "split": "train"} for p in generated])
    assert [p.prompt_id for p in make_task(data_file=str(path)).prompts("train")] == [p.prompt_id for p in generated]


def test_oracle_dataset_takes_the_task_params(tmp_path: Path) -> None:
    path = tmp_path / "oracle.jsonl"
    # The pipeline calls it as write_oracle_dataset(path, split="train", **task.params).
    assert write_oracle_dataset(path, split="train", digits=3, operators="*", n_train=12, n_test=2) == 12
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    task = make_task(digits=3, operators="*", n_train=12, n_test=2)
    for row, p in zip(rows, task.prompts("train"), strict=True):
        assert row == {"messages": task.messages(p) + [{"role": "assistant", "content": str(p.metadata["answer"])}],
                       "tools": []}
    assert write_oracle_dataset(path, split="test", n=1) == 1
