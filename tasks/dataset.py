"""A dataset as a task: prompts from the files people already have (TRL, verl, OpenRLHF layouts), no module to write.

    task:
      name: dataset
      params: {path: data/gsm8k.parquet, prompt: question, answer: answer, template: "{prompt} Put the answer after ####."}

`path` is a Parquet, JSONL, JSON, CSV or Arrow file, a folder or glob of them, or a `datasets` `save_to_disk`
folder; `builder` reads it through `datasets.load_dataset(builder, data_files=path)`; `files` gives one path per
split ({train: a.parquet, test: b.parquet}). Reading is tasks/data_files.py's: Parquet lazily, so a
1,000,000-row file is checked and sampled from without loading it (bench/bench_dataset.py).

Each row is one prompt:
- `prompt` names the prompt column (dotted for a nested field). A string is a plain prompt: the user message,
  through `template` when given (`{prompt}` and any column by name) and after `system_prompt` when given. A list
  of `{role, content}` messages is a conversational prompt, used as it is (`system_prompt` is put first only
  when it has no system message). Anything else is a config error naming the column's type.
- Every other column goes into the prompt's metadata under its own name (so TRL-style rewards get the columns as
  keyword lists, and SQL sees them in `rollouts.metadata`), with `prompt_format` ("text" or "messages": how TRL
  would hand the rewards their completions); `answer` names the ground-truth column (dotted allowed), copied to
  metadata["answer"], which rlops' own rewards (numeric_match, exact_match, rewards.math) read.
- `id` names an id column; without one a prompt's id is a hash of its prompt, so it is the same in every run.
- `python_tool: true` gives the agent the sandboxed `python` tool (tasks/python_tool.py), taught in the system
  message as every rlops tool is; `max_turns` bounds the turns.

verl's layout (`data_source`, `prompt` as messages, `ability`, `reward_model: {style, ground_truth}`, `extra_info`)
is read as it is: `format: verl`, or found by its columns, sets `answer` to `reward_model.ground_truth`.

Splits, first that applies: `files`; a split source (a DatasetDict folder or builder with more than a "train"
split, or a folder of train.* / test.* files);
`split_column` (its values name the splits); else a seeded hold-out of `test_fraction` of the rows ("test"; the rest
"train"), decided per row by the id column's value when there is one, else by the row's position, so a row keeps its
split when rows are appended. The data's content hash (every file) is the task's `data_version`, part of every
rollout batch id: edited data makes new rollouts.

What cannot work is a `TaskParamsError` raised while the task is built, which config validation does before any
compute: a file that is missing, empty or unreadable, a column that is not there (named, with the columns there
are), a prompt column of the wrong type.
"""

from __future__ import annotations

import datetime
import decimal
import hashlib
import string
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import numpy as np
import pyarrow as pa

from storage.ids import canonical_json
from tasks.base import Prompt, Task, TaskParamsError, render_system_prompt
from tasks.data_files import DataFileError, Rows, fingerprint, open_sources

VERL_COLUMNS = {"data_source", "prompt", "reward_model"}
ITER_CHUNK = 1024  # rows read at a time when a whole split is iterated


def make_task(
    path: str | None = None,
    files: dict[str, str] | None = None,
    builder: str | None = None,
    format: Literal["auto", "columns", "verl"] = "auto",  # noqa: A002 - the name users know from verl/TRL docs
    prompt: str = "prompt",
    answer: str | None = None,
    id: str | None = None,  # noqa: A002
    split_column: str | None = None,
    test_fraction: float = 0.1,
    seed: int = 0,
    system_prompt: str | None = None,
    template: str | None = None,
    max_turns: int = 1,
    python_tool: bool = False,
) -> Task:
    """Build the task from the data at `path` (or `files`, one path per split); see the module docstring."""
    if (path is None) == (files is None):
        raise TaskParamsError(["task.params.path: give `path` (a file, folder or glob) or `files` (split -> path), one of them"])
    if not 0.0 <= test_fraction < 1.0:
        raise TaskParamsError([f"task.params.test_fraction: must be in [0, 1), got {test_fraction}"])
    try:
        if files is not None:
            sources = {}
            for split, where in files.items():
                opened = open_sources(where, builder)
                if list(opened) != [None]:
                    raise TaskParamsError([f"task.params.files.{split}: {where} holds splits itself "
                                           f"({', '.join(map(str, opened))}): give it as `path`"])
                sources[split] = opened[None]
            version = fingerprint_all(files.values())
        else:
            sources = open_sources(path, builder)
            version = fingerprint_all([path])
    except DataFileError as e:
        raise TaskParamsError([f"task.params.{'files' if files is not None else 'path'}: {e}"]) from e
    first = next(iter(sources.values()))
    layout = "verl" if format == "verl" or (format == "auto" and VERL_COLUMNS <= set(first.schema.names)) else "columns"
    if layout == "verl" and answer is None:
        answer = "reward_model.ground_truth"
    tools, specs = {}, []
    if python_tool:  # a code agent: the sandboxed `python` tool (tasks/python_tool.py), taught in the system prompt
        from tasks.python_tool import SPEC, python

        tools, specs = {"python": python}, [SPEC]
    spec = RowSpec(prompt=prompt, answer=answer, id=id, system_prompt=system_prompt, template=template,
                   tool_specs=specs)
    problems = [p for name, rows in sources.items() for p in spec.problems(rows, name, split_column)]
    if problems:
        raise TaskParamsError(problems)
    splits = split_positions(sources, split_column, test_fraction, seed, id)

    def prompts(split: str) -> PromptRows:
        if split not in splits:
            raise ValueError(f"the dataset has splits {tuple(splits)}, not {split!r}")
        rows, positions = splits[split]
        return PromptRows(rows, positions, spec.prompt_of)

    return Task(name="dataset", system_prompt=system_prompt or "", prompts=prompts, max_turns=max_turns,
                data_version=version, tools=tools, tool_specs=specs)


def fingerprint_all(paths: Any) -> str:
    """One hash over the content of every data path (tasks.data_files.fingerprint)."""
    return hashlib.sha256("\n".join(fingerprint(p) for p in paths).encode()).hexdigest()[:16]


class RowSpec:
    """How a row becomes a Prompt: which columns hold the prompt, the answer and the id, and the prompt's framing."""

    def __init__(self, *, prompt: str, answer: str | None, id: str | None, system_prompt: str | None,  # noqa: A002
                 template: str | None, tool_specs: list[dict[str, Any]]) -> None:
        self.prompt, self.answer, self.id = prompt, answer, id
        self.system_prompt, self.template, self.tool_specs = system_prompt, template, tool_specs

    def problems(self, rows: Rows, split: str | None, split_column: str | None) -> list[str]:
        """What is wrong with this spec on `rows` (empty, a missing column, a prompt column of the wrong type)."""
        where = f" (split {split!r})" if split is not None else ""
        if rows.num_rows == 0:
            return [f"task.params.path: the data{where} has no rows"]
        out = []
        for param, column in (("prompt", self.prompt), ("answer", self.answer), ("id", self.id),
                              ("split_column", split_column)):
            if column is not None and field_type(rows.schema, column) is None:
                out.append(f"task.params.{param}: no column {column!r}{where}; the data has: {describe_columns(rows.schema)}")
        kind = field_type(rows.schema, self.prompt)
        if kind is not None and prompt_kind(kind) is None:
            out.append(f"task.params.prompt: column {self.prompt!r} is {kind}{where}: a prompt is a string or a list of "
                       "{role, content} messages")
        if self.template is not None and kind is not None and prompt_kind(kind) == "messages":
            out.append("task.params.template: the prompts are messages; a template applies to plain-text prompts only")
        if self.template is not None:
            try:
                fields = {f.split(".")[0].split("[")[0] for _, f, _, _ in string.Formatter().parse(self.template) if f}
            except ValueError as e:
                return out + [f"task.params.template: not a format string ({e}); write a literal brace as {{{{ or }}}}"]
            out += [f"task.params.template: {{{f}}} is not a column; the data has: {describe_columns(rows.schema)}"
                    for f in sorted(fields - {"prompt"} - set(rows.schema.names))]
        return out

    def prompt_of(self, row: dict[str, Any]) -> Prompt:
        """The Prompt of one row (as `Table.to_pylist` gives it)."""
        value = get_path(row, self.prompt)
        metadata = {k: jsonable(v) for k, v in row.items() if k != self.prompt}
        if self.answer is not None:
            metadata["answer"] = jsonable(get_path(row, self.answer))
        pid = str(get_path(row, self.id)) if self.id is not None else "ds-" + hashlib.sha1(
            canonical_json(value).encode()).hexdigest()[:12]
        if isinstance(value, str):
            text = value if self.template is None else self.template.format_map({**row, "prompt": value})
            messages = [{"role": "user", "content": text}]
            kind = "text"
        else:
            messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in value]
            kind = "messages"
        system = next((m for m in messages if m["role"] == "system"), None)
        if system is None and (self.system_prompt or self.tool_specs):
            system = {"role": "system", "content": self.system_prompt or ""}
            messages.insert(0, system)
        if system is not None and self.tool_specs:  # the tools and their call format, as every rlops task teaches them
            system["content"] = render_system_prompt(system["content"], self.tool_specs).strip()
        if kind == "text":
            return Prompt(pid, text, {**metadata, "prompt_format": "text"}, tuple(messages))
        question = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        return Prompt(pid, question, {**metadata, "prompt_format": "messages"}, tuple(messages))


class PromptRows(Sequence[Prompt]):
    """A split's prompts, read from their rows when asked for: `len` is free, `take` reads many in one pass."""

    def __init__(self, rows: Rows, positions: np.ndarray, prompt_of: Callable[[dict[str, Any]], Prompt]) -> None:
        self.rows, self.positions, self.prompt_of = rows, positions, prompt_of

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return self.take(list(range(len(self)))[i])
        if not -len(self) <= i < len(self):
            raise IndexError(f"prompt {i} of {len(self)}")
        return self.take([i % len(self)])[0]

    def take(self, indices: list[int]) -> list[Prompt]:
        """The prompts at `indices` of this split, in that order."""
        if not indices:
            return []
        table = self.rows.take([int(self.positions[i]) for i in indices])
        return [self.prompt_of(row) for row in table.to_pylist()]

    def __iter__(self) -> Iterator[Prompt]:
        for start in range(0, len(self), ITER_CHUNK):
            yield from self.take(list(range(start, min(start + ITER_CHUNK, len(self)))))


def split_positions(sources: dict[str | None, Rows], split_column: str | None, test_fraction: float, seed: int,
                    id_column: str | None) -> dict[str, tuple[Rows, np.ndarray]]:
    """split name -> (its rows, the row positions in it), in row order. A source whose one split is "train"
    (what `load_dataset` makes of plain files) is split like an unsplit one."""
    if list(sources) == ["train"]:
        sources = {None: sources["train"]}
    if None not in sources:
        return {str(name): (rows, np.arange(rows.num_rows)) for name, rows in sources.items()}
    rows = sources[None]
    if split_column is not None:
        values = np.array(column_values(rows, split_column).to_pylist(), dtype=object)
        return {str(v): (rows, np.flatnonzero(values == v)) for v in dict.fromkeys(values.tolist())}
    keys = np.arange(rows.num_rows, dtype=np.uint64)
    if id_column is not None:
        ids = column_values(rows, id_column)
        if pa.types.is_integer(ids.type):
            keys = np.asarray(ids.to_numpy(zero_copy_only=False), dtype=np.int64).astype(np.uint64)
        else:
            keys = np.array([int.from_bytes(hashlib.sha1(str(v).encode()).digest()[:8], "little")
                             for v in ids.to_pylist()], dtype=np.uint64)
    test = held_out(keys, seed, test_fraction)
    return {"train": (rows, np.flatnonzero(~test)), "test": (rows, np.flatnonzero(test))}


def held_out(keys: np.ndarray, seed: int, fraction: float) -> np.ndarray:
    """True where a key falls in the held-out `fraction`: splitmix64 of (key, seed), vectorised (1M keys in ms)."""
    with np.errstate(over="ignore"):
        x = keys + np.uint64((seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % 2**64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / 2.0**53 < fraction


def column_values(rows: Rows, dotted: str) -> pa.ChunkedArray:
    """A column, or a field inside a struct column (`reward_model.ground_truth`), read alone."""
    head, *rest = dotted.split(".")
    column = rows.column(head)
    for name in rest:
        column = pa.chunked_array([chunk.field(name) for chunk in column.chunks], type=column.type.field(name).type)
    return column


def field_type(schema: pa.Schema, dotted: str) -> pa.DataType | None:
    """The type of a column or nested struct field, None where there is no such field."""
    head, *rest = dotted.split(".")
    if head not in schema.names:
        return None
    kind = schema.field(head).type
    for name in rest:
        if not pa.types.is_struct(kind) or kind.get_field_index(name) < 0:
            return None
        kind = kind.field(name).type
    return kind


def prompt_kind(kind: pa.DataType) -> Literal["text", "messages"] | None:
    """"text" for a string column, "messages" for a list of structs with role and content, else None."""
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return "text"
    if (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_struct(kind.value_type):
        names = {kind.value_type.field(i).name for i in range(kind.value_type.num_fields)}
        return "messages" if {"role", "content"} <= names else None
    return None


def describe_columns(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name} ({f.type})" if len(str(f.type)) <= 40 else f.name for f in schema)


def get_path(row: dict[str, Any], dotted: str) -> Any:
    value: Any = row
    for name in dotted.split("."):
        value = value.get(name) if isinstance(value, dict) else None
    return value


def jsonable(value: Any) -> Any:
    """A cell as a JSON value (rollouts.metadata is JSON): dates as ISO text, decimals as floats, bytes as hex."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value
