"""The dataset task: every file kind gives the same prompts, verl's and TRL's layouts read as they are, splits,
large Parquet files read lazily, the data's hash in the rollout ids, and bad data named before any compute."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from flows.config import ConfigError
from flows.run_config import load_run_config
from tasks.base import TaskParamsError, content_digest, load_task, pick
from tasks.data_files import ParquetRows
from tasks.dataset import held_out
from tests.flows.conftest import tiny_config

ROWS = [{"question": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1), "level": i % 3} for i in range(40)]


def write(path: Path, rows: list[dict], kind: str) -> Path:
    """`rows` as a file of `kind` at `path` (its suffix added)."""
    path = path.with_suffix(f".{kind}")
    table = pa.Table.from_pylist(rows)
    if kind == "parquet":
        pq.write_table(table, path)
    elif kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "json":
        path.write_text(json.dumps(rows))
    elif kind == "csv":
        pcsv.write_csv(table, path)
    elif kind == "arrow":
        with pa.ipc.new_file(str(path), table.schema) as w:
            w.write_table(table)
    return path


def task_of(**params):
    return load_task("dataset", {"prompt": "question", "answer": "answer", **params})


def everything(task) -> list[tuple]:
    return [(s, p.prompt_id, p.question, p.metadata) for s in ("train", "test") for p in task.prompts(s)]


def test_every_file_kind_folder_glob_and_datasets_folder_give_the_same_prompts(tmp_path):
    import datasets

    reference = everything(task_of(path=str(write(tmp_path / "ref", ROWS, "jsonl"))))
    assert len(reference) == 40 and {r[0] for r in reference} == {"train", "test"}
    for kind in ("parquet", "json", "csv", "arrow"):
        got = everything(task_of(path=str(write(tmp_path / "one", ROWS, kind))))
        if kind == "csv":  # CSV has no types: its cells are inferred, "1" reads as 1 (as datasets' CSV loader does)
            got = [(*r[:3], {**r[3], "answer": str(r[3]["answer"])}) for r in got]
        assert got == reference, kind
    shards = tmp_path / "shards"
    shards.mkdir()
    for k in range(4):  # a folder and a glob of shards read as one table, in file order
        write(shards / f"part-{k}", ROWS[10 * k:10 * k + 10], "parquet")
    assert everything(task_of(path=str(shards))) == reference
    assert everything(task_of(path=str(shards / "part-*.parquet"))) == reference
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    assert everything(task_of(path=str(tmp_path / "saved"))) == reference
    # load_dataset's one "train" split is held out from like a single file
    assert everything(task_of(path=str(tmp_path / "ref.jsonl"), builder="json")) == reference


def test_plain_prompts_take_the_template_and_system_prompt_and_keep_every_column(tmp_path):
    task = task_of(path=str(write(tmp_path / "d", ROWS, "jsonl")), system_prompt="Be brief.",
                   template="{prompt} (level {level}) Answer after ####.")
    p = next(p for p in task.prompts("train") if p.metadata["answer"] == "3")
    assert task.messages(p) == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "What is 1 + 2? (level 1) Answer after ####."}]
    assert p.metadata == {"answer": "3", "level": 1, "prompt_format": "text"}
    # the id hashes the row's prompt, not its framing: a new template compares with the old run prompt by prompt
    plain = task_of(path=str(tmp_path / "d.jsonl"))
    assert p.prompt_id in {q.prompt_id for q in plain.prompts("train")} and p.prompt_id.startswith("ds-")


def test_conversational_prompts_are_used_as_they_are_and_a_system_prompt_goes_first_only_when_missing(tmp_path):
    chats = [{"prompt": [{"role": "user", "content": "Hi"}], "solution": "1"},
             {"prompt": [{"role": "system", "content": "Mine."}, {"role": "user", "content": "Yo"},
                         {"role": "assistant", "content": "?"}, {"role": "user", "content": "2+2"}], "solution": "4"}]
    task = load_task("dataset", {"path": str(write(tmp_path / "c", chats, "parquet")), "test_fraction": 0.0,
                                 "system_prompt": "Default."})
    first, second = task.prompts("train")
    assert task.messages(first) == [{"role": "system", "content": "Default."}, {"role": "user", "content": "Hi"}]
    assert task.messages(second) == chats[1]["prompt"] and second.question == "2+2"
    assert second.metadata == {"solution": "4", "prompt_format": "messages"}


def test_verl_layout_is_found_by_its_columns_and_its_ground_truth_is_the_answer(tmp_path):
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"q{i}"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"split": "train", "index": i}}
            for i in range(6)]
    path = write(tmp_path / "train", rows, "parquet")
    write(tmp_path / "test", rows[:2], "parquet")
    for task in (load_task("dataset", {"path": str(tmp_path)}),  # a folder of train.* / test.* files is split
                 load_task("dataset", {"files": {"train": str(path), "test": str(tmp_path / "test.parquet")},
                                       "format": "verl"})):
        assert [len(task.prompts(s)) for s in ("train", "test")] == [6, 2]
        p = task.prompts("train")[3]
        assert p.metadata["answer"] == "3" and p.metadata["data_source"] == "openai/gsm8k"
        assert p.metadata["extra_info"] == {"split": "train", "index": 3} and "prompt" not in p.metadata
    by_index = load_task("dataset", {"path": str(path), "id": "extra_info.index", "test_fraction": 0.0})
    assert [p.prompt_id for p in by_index.prompts("train")] == [str(i) for i in range(6)]


def test_splits_from_a_column_and_a_hold_out_that_keeps_each_row_in_its_split_as_rows_are_appended(tmp_path):
    rows = [dict(r, part="test" if i % 4 == 0 else "train") for i, r in enumerate(ROWS)]
    by_column = task_of(path=str(write(tmp_path / "s", rows, "jsonl")), split_column="part")
    assert len(by_column.prompts("test")) == 10 and len(by_column.prompts("train")) == 30
    few = task_of(path=str(write(tmp_path / "few", ROWS[:20], "parquet")), test_fraction=0.25, seed=1)
    more = task_of(path=str(write(tmp_path / "more", ROWS, "parquet")), test_fraction=0.25, seed=1)
    assert {p.prompt_id for p in few.prompts("test")} <= {p.prompt_id for p in more.prompts("test")}
    assert {p.prompt_id for p in few.prompts("train")} <= {p.prompt_id for p in more.prompts("train")}
    other_seed = task_of(path=str(tmp_path / "more.parquet"), test_fraction=0.25, seed=2)
    assert [p.prompt_id for p in other_seed.prompts("test")] != [p.prompt_id for p in more.prompts("test")]
    fraction = held_out(__import__("numpy").arange(100_000, dtype="uint64"), seed=0, fraction=0.1).mean()
    assert 0.095 < fraction < 0.105


def test_parquet_rows_are_taken_across_row_groups_and_files_in_the_order_asked(tmp_path):
    table = pa.table({"i": list(range(1000)), "s": [f"r{i}" for i in range(1000)]})
    pq.write_table(table.slice(0, 600), tmp_path / "a.parquet", row_group_size=128)
    pq.write_table(table.slice(600), tmp_path / "b.parquet", row_group_size=50)
    rows = ParquetRows([tmp_path / "a.parquet", tmp_path / "b.parquet"])
    assert rows.num_rows == 1000 and rows.column("i").to_pylist() == list(range(1000))
    wanted = [999, 0, 127, 128, 600, 650, 127, 5]
    assert rows.take(wanted).column("i").to_pylist() == wanted
    with pytest.raises(IndexError):
        rows.take([1000])


def test_the_data_hash_enters_the_rollout_content_so_edited_data_makes_new_rollouts(tmp_path):
    path = write(tmp_path / "d", ROWS, "parquet")
    task = task_of(path=str(path), test_fraction=0.0)
    before = content_digest(task, pick(task.prompts("train"), [0, 1]))
    write(tmp_path / "d", ROWS[:39] + [dict(ROWS[39], level=9)], "parquet")  # a row the step does not use
    edited = task_of(path=str(path), test_fraction=0.0)
    assert edited.data_version != task.data_version
    assert content_digest(edited, pick(edited.prompts("train"), [0, 1])) != before


@pytest.mark.parametrize("setup,params,expected", [
    (lambda d: write(d / "x", ROWS, "jsonl"), {"prompt": "query"},
     "task.params.prompt: no column 'query'; the data has: question (string), answer (string), level (int64)"),
    (lambda d: write(d / "x", ROWS, "jsonl"), {"prompt": "question", "answer": "solution", "id": "uid"},
     "task.params.answer: no column 'solution'"),
    (lambda d: write(d / "x", ROWS, "jsonl"), {"prompt": "level"},
     "task.params.prompt: column 'level' is int64: a prompt is a string or a list of {role, content} messages"),
    (lambda d: (d / "x.jsonl").write_text(""), {}, "task.params.path: the data has no rows"),
    (lambda d: (d / "x.parquet").write_bytes(b"not parquet at all"), {}, "x.parquet: not a readable Parquet file"),
    (lambda d: (d / "x.jsonl").write_text('{"prompt": "a"}\n{oops\n'), {}, "x.jsonl:2: not valid JSON"),
    (lambda d: None, {}, "x.jsonl: no such file or folder"),
])
def test_bad_data_is_a_params_error_naming_what_is_wrong(tmp_path, setup, params, expected):
    setup(tmp_path)
    found = sorted(tmp_path.glob("x.*"))
    path = str(found[0]) if found else str(tmp_path / "x.jsonl")
    with pytest.raises(TaskParamsError) as err:
        load_task("dataset", {"path": path, **params})
    assert any(expected in p for p in err.value.problems), err.value.problems


def test_a_config_lists_every_problem_of_its_data_and_rewards_before_any_compute(tmp_path):
    data = tiny_config(tmp_path)  # a folder that exists: no model is loaded to check a config
    data["task"] = {"name": "dataset", "params": {"path": str(write(tmp_path / "d", ROWS, "jsonl")), "prompt": "q"}}
    data["score"] = {"rewards": [
        {"name": "acc", "fn": "trl.rewards.accuracy_reward"},  # a TRL function without `style: trl`
        {"name": "verl_on_trl", "fn": "trl.rewards.think_format_reward", "style": "verl"},
        {"name": "bad_factory", "fn": "trl.rewards.get_soft_overlong_punishment", "style": "trl",
         "params": {"max_len": 3}}]}
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as err:
        load_run_config(path)
    text = str(err.value)
    assert "(4 problems)" in text
    assert "task.params.prompt: no column 'q'; the data has: question (string)" in text
    assert "score.rewards.acc: 'trl.rewards.accuracy_reward' is not declared as a reward" in text
    assert "set `style: trl` (its signature is trl's)" in text
    assert "score.rewards.verl_on_trl: trl.rewards.think_format_reward has trl's signature" in text
    assert "score.rewards.bad_factory: trl.rewards.get_soft_overlong_punishment(**{'max_len': 3}) failed" in text


def test_a_trl_reward_whose_column_the_data_lacks_is_a_config_error(tmp_path):
    data = tiny_config(tmp_path / "no-model-needed")
    data["task"] = {"name": "dataset", "params": {"path": str(write(tmp_path / "d", ROWS, "jsonl")),
                                                  "prompt": "question"}}
    data["score"] = {"rewards": [{"name": "acc", "fn": "trl.rewards.accuracy_reward", "style": "trl"}]}
    data["eval"]["metric"] = "acc"
    path = tmp_path / "cols.yaml"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="score.rewards.acc: trl.rewards.accuracy_reward needs the column"
                                          r"\(s\) solution, which the task's prompts do not have"):
        load_run_config(path)
