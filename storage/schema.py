"""The one schema module: Arrow schemas of the Parquet tables and the typed records
that map 1:1 onto them (DESIGN.md, "Data contracts").

Every stage imports its records from here. `to_table` / `from_table` convert a list
of records to an Arrow table and back, so the Parquet files, the DuckDB views and
the Python objects always agree on column names and types.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from typing import Any, TypeVar

import pyarrow as pa

from storage.loop_schema import loop_tables

# 2: rollouts gained `segment_starts` (files of version 1 lack it and read as one segment each).
# 3: rollouts gained `image_ids` (older files lack it and read as no images).
SCHEMA_VERSION = 3

TOOL_CALL = pa.struct([("id", pa.string()), ("name", pa.string()), ("arguments", pa.string())])
MESSAGE = pa.struct(
    [
        ("role", pa.string()),
        ("content", pa.string()),
        ("tool_calls", pa.list_(TOOL_CALL)),
        ("tool_call_id", pa.string()),
        ("name", pa.string()),
    ]
)
TS = pa.timestamp("us", tz="UTC")

ROLLOUTS = pa.schema(
    [
        ("rollout_id", pa.string()),
        ("batch_id", pa.string()),
        ("policy_id", pa.string()),
        ("task", pa.string()),
        ("split", pa.string()),
        ("prompt_id", pa.string()),
        ("group_id", pa.string()),
        ("sample_idx", pa.int32()),
        ("messages", pa.list_(MESSAGE)),
        ("token_ids", pa.list_(pa.int32())),
        ("num_tokens", pa.int32()),  # len(token_ids): length audits without decoding the token lists
        ("loss_mask", pa.list_(pa.int8())),  # 1 = token sampled from the policy
        ("behavior_logprobs", pa.list_(pa.float32())),  # aligned with token_ids; 0 where mask is 0
        # Offsets in token_ids where a new segment (a separate training sequence) starts, besides 0;
        # empty (or null, in version-1 files): the row is one sequence. See `Rollout.segments`.
        ("segment_starts", pa.list_(pa.int32())),
        # sha256 ids of the images the episode's model saw, in the order their placeholder tokens appear in
        # token_ids (storage/images.py; join with the `images` view); empty for a text-only episode.
        ("image_ids", pa.list_(pa.string())),
        ("num_turns", pa.int32()),
        ("num_tool_calls", pa.int32()),
        ("finish_reason", pa.string()),  # answer | max_turns | max_tokens | error
        ("truncated", pa.bool_()),
        ("metadata", pa.string()),  # JSON: ground truth and task fields
        ("sampling", pa.string()),  # JSON: temperature, top_p, max_new_tokens, ...
        ("seed", pa.int64()),
        ("gen_seconds", pa.float64()),
        ("created_at", TS),
        ("schema_version", pa.int32()),
    ]
)

REWARDS = pa.schema(
    [
        ("rollout_id", pa.string()),
        ("batch_id", pa.string()),  # the rollout batch
        ("reward_name", pa.string()),
        ("reward_version", pa.string()),
        ("value", pa.float64()),  # null on error
        ("details", pa.string()),  # JSON
        ("error", pa.string()),
        ("score_batch_id", pa.string()),  # the reward batch (artifact) that wrote this row
        ("scored_at", TS),
        ("schema_version", pa.int32()),
    ]
)

EVALS = pa.schema(
    [
        ("policy_id", pa.string()),
        ("task", pa.string()),
        ("split", pa.string()),
        ("metric", pa.string()),
        ("value", pa.float64()),
        ("n", pa.int64()),
        ("eval_batch_id", pa.string()),
        ("created_at", TS),
        ("schema_version", pa.int32()),
    ]
)

# People's judgements of episodes (`rlops review`, storage/labels.py): append-only, one row per labelled episode
# of a submission. A grade is one row; an ordering of a group is one row per ranked episode, best first.
LABELS = pa.schema(
    [
        ("label_id", pa.string()),  # <submission_id>-<position>
        ("submission_id", pa.string()),  # one per grade or ordering sent; the catalog artifact holding the rows
        ("workspace_id", pa.string()),  # the workspace the reviewer's page was serving (Workspace.workspace_id)
        ("reviewer", pa.string()),
        ("kind", pa.string()),  # grade | order
        ("rollout_id", pa.string()),
        ("batch_id", pa.string()),
        ("group_id", pa.string()),
        ("value", pa.float64()),  # in [0, 1]: the grade (good 1, bad 0), or an ordering's (n - rank) / (n - 1)
        ("rank", pa.int32()),  # order: 1 = best; null for a grade
        ("ranked", pa.int32()),  # order: how many episodes the ordering holds; null for a grade
        ("note", pa.string()),
        ("created_at", TS),
        ("schema_version", pa.int32()),
    ]
)

# Parquet table kind -> schema. The data folder has one subfolder per kind. The deployment loop's tables (`traffic`,
# `feedback`, `verdicts`) are storage/loop_schema.py's.
TABLES: dict[str, pa.Schema] = {"rollouts": ROLLOUTS, "rewards": REWARDS, "evals": EVALS, "labels": LABELS,
                                **loop_tables(MESSAGE, TS)}


def now() -> datetime:
    return datetime.now(timezone.utc)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text exactly as the model wrote it (may be malformed)


@dataclass
class Message:
    """One chat message in the OpenAI shape (tool calls included)."""

    role: str
    content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """The message as an OpenAI chat dict (what chat templates and judges take)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


@dataclass
class Rollout:
    """One agent episode; one row of `rollouts`."""

    rollout_id: str
    batch_id: str
    policy_id: str
    task: str
    split: str
    prompt_id: str
    group_id: str
    sample_idx: int
    messages: list[Message]
    token_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    num_turns: int
    num_tool_calls: int
    finish_reason: str
    truncated: bool
    metadata: dict[str, Any]
    sampling: dict[str, Any]
    seed: int
    gen_seconds: float
    created_at: datetime = field(default_factory=now)
    schema_version: int = SCHEMA_VERSION
    num_tokens: int = 0  # derived: always len(token_ids)
    segment_starts: list[int] = field(default_factory=list)  # see `segments`; empty: one segment
    image_ids: list[str] = field(default_factory=list)  # stored images, in placeholder order; empty: text only

    def __post_init__(self) -> None:
        self.num_tokens = len(self.token_ids)
        if self.segment_starts is None:  # a version-1 file read through a view that has the column
            self.segment_starts = []
        if self.image_ids is None:  # a file older than version 3 read through a view that has the column
            self.image_ids = []

    def segments(self) -> list[tuple[int, int]]:
        """(start, end) of each segment of token_ids, in order.

        A segment is one self-contained sequence: its tokens are what the policy saw (prompt, mask 0)
        and sampled (mask 1), from position 0. An episode is one segment when every model call's
        prompt extended the previous prompt and completion token for token (the built-in agent
        loop always); an external agent that rewrites its history, or a chat template that is not
        prefix-preserving, starts a new segment at that call. Every sampled token is in exactly one
        segment with mask 1, and GRPO trains each segment with the episode's advantage.
        """
        return segment_bounds(self.segment_starts, len(self.token_ids))


@dataclass
class RewardRow:
    """One reward value for one rollout under one reward version; one row of `rewards`."""

    rollout_id: str
    batch_id: str
    reward_name: str
    reward_version: str
    value: float | None
    details: dict[str, Any] | None
    error: str | None
    score_batch_id: str
    scored_at: datetime = field(default_factory=now)
    schema_version: int = SCHEMA_VERSION


@dataclass
class EvalRow:
    """One metric of one policy on one task split; one row of `evals`."""

    policy_id: str
    task: str
    split: str
    metric: str
    value: float
    n: int
    eval_batch_id: str
    created_at: datetime = field(default_factory=now)
    schema_version: int = SCHEMA_VERSION


def segment_bounds(segment_starts: list[int] | None, num_tokens: int) -> list[tuple[int, int]]:
    """(start, end) pairs of the segments of a token list of length `num_tokens`."""
    edges = [0, *(segment_starts or []), num_tokens]
    return [(a, b) for a, b in zip(edges, edges[1:])]


@dataclass
class Label:
    """One person's judgement of one episode; one row of `labels` (see LABELS)."""

    label_id: str
    submission_id: str
    workspace_id: str
    reviewer: str
    kind: str
    rollout_id: str
    batch_id: str
    group_id: str
    value: float
    rank: int | None
    ranked: int | None
    note: str | None
    created_at: datetime = field(default_factory=now)
    schema_version: int = SCHEMA_VERSION


R = TypeVar("R", Rollout, RewardRow, EvalRow, Label)
_RECORDS: dict[type, pa.Schema] = {Rollout: ROLLOUTS, RewardRow: REWARDS, EvalRow: EVALS, Label: LABELS}
_JSON_COLUMNS = {"metadata", "sampling", "details"}


def _encode(name: str, value: Any) -> Any:
    if name in _JSON_COLUMNS:
        return None if value is None else json.dumps(value, sort_keys=True)
    if name == "messages":
        return [asdict(m) for m in value]
    return value


def _column(table: pa.Table, name: str) -> list[Any]:
    """One column as Python values; JSON parsed, messages rebuilt as `Message` records."""
    col = table[name].combine_chunks()
    if name in _JSON_COLUMNS:
        return [None if v is None else json.loads(v) for v in col.to_pylist()]
    if name == "messages":
        return _messages(col)
    return col.to_pylist()


def _messages(col: pa.ListArray) -> list[list[Message]]:
    # Field-wise conversion: ~5x faster than to_pylist() of the nested structs, which matters when
    # rescoring a million stored rollouts.
    flat = col.values
    role, content, call_id, name = (flat.field(f).to_pylist() for f in ("role", "content", "tool_call_id", "name"))
    calls = flat.field("tool_calls")
    call_offsets = calls.offsets.to_pylist()
    cid, cname, cargs = (calls.values.field(f).to_pylist() for f in ("id", "name", "arguments"))
    messages = [
        Message(role[i], content[i],
                [ToolCall(cid[j], cname[j], cargs[j]) for j in range(call_offsets[i], call_offsets[i + 1])]
                if call_offsets[i] != call_offsets[i + 1] else [],
                call_id[i], name[i])
        for i in range(len(flat))
    ]
    offsets = col.offsets.to_pylist()
    return [messages[offsets[k] : offsets[k + 1]] for k in range(len(col))]


def to_table(records: list[R], cls: type[R] | None = None) -> pa.Table:
    """Records -> Arrow table with the exact schema of their Parquet table."""
    cls = cls or type(records[0])
    schema = _RECORDS[cls]
    columns = {f.name: [_encode(f.name, getattr(r, f.name)) for r in records] for f in fields(cls)}
    return pa.Table.from_pydict(columns, schema=schema)


def from_table(table: pa.Table, cls: type[R]) -> list[R]:
    """Arrow table (from Parquet or DuckDB) -> records. Extra columns are ignored."""
    optional = {"num_tokens", "segment_starts", "image_ids"}  # derived, or absent from older files: defaults apply
    missing = [f.name for f in fields(cls) if f.name not in table.column_names and f.name not in optional]
    if missing:
        raise KeyError(f"table lacks columns {missing} of {cls.__name__}")
    names = [f.name for f in fields(cls) if f.name in table.column_names]
    columns = [_column(table, n) for n in names]
    if names == [f.name for f in fields(cls)][: len(names)]:
        # Only trailing optional fields are left out: positional construction is exact, and ~2x
        # faster than keywords on a million rows.
        return [cls(*values) for values in zip(*columns)]
    return [cls(**dict(zip(names, values))) for values in zip(*columns)]


def reward_table(rollout_ids: pa.Array | list[str], batch_id: str, reward_name: str, reward_version: str,
                 values: list[float | None], details: list[dict[str, Any] | str | None], errors: list[str | None],
                 score_batch_id: str, scored_at: datetime) -> pa.Table:
    """The `rewards` rows of one reward version over one rollout batch, built column-wise.

    Equal to `to_table([RewardRow(...) ...])` without a Python object per row: the score stage
    writes millions of these when it rescores. A `details` entry may be given already JSON-encoded.
    """
    n = len(rollout_ids)
    if not len(values) == len(details) == len(errors) == n:
        raise ValueError("rollout_ids, values, details and errors must be equally long")

    def same(value: Any, typ: pa.DataType) -> pa.Array:
        return pa.repeat(pa.scalar(value, typ), n)

    columns = [
        pa.array(rollout_ids, pa.string()),
        same(batch_id, pa.string()),
        same(reward_name, pa.string()),
        same(reward_version, pa.string()),
        pa.array(values, pa.float64()),
        pa.array([d if d is None or isinstance(d, str) else _encode("details", d) for d in details], pa.string()),
        pa.array(errors, pa.string()),
        same(score_batch_id, pa.string()),
        same(scored_at, TS),
        same(SCHEMA_VERSION, pa.int32()),
    ]
    return pa.Table.from_arrays(columns, schema=REWARDS)
