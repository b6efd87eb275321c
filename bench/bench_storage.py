"""Storage benchmark: write 1,000,000 synthetic rollouts of realistic size, then time audit queries.

    .venv/bin/python bench/bench_storage.py [--rows 1000000] [--workspace /tmp/rlops-bench]

Rollouts: 6 messages (system, user, assistant tool call, tool result, assistant tool call... answer),
~300 tokens with mask and behaviour log-probs. 100 batches ("steps") of 10,000 rollouts, groups of 8,
and two reward versions per rollout (the second disagrees on ~5 %). Data is built column-wise with
numpy so that generating it does not dominate the measurement; the write path is the real one
(`Workspace.write_part` + catalog registration).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import loopback  # bench/loopback.py: run under .ci/loopback

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from storage.schema import MESSAGE, REWARDS, ROLLOUTS, SCHEMA_VERSION  # noqa: E402
from storage.sql import Sandbox  # noqa: E402
from storage.workspace import Workspace  # noqa: E402

CONTENTS = [
    ("system", "You are a research assistant. Use the search and read tools to answer questions about the knowledge base."),
    ("user", "In which year was the Vexhollow Dynamics plant in Marrowgate opened, and who led the project?"),
    ("assistant", '<tool_call>{"name": "search", "arguments": {"query": "Vexhollow Dynamics Marrowgate plant opened"}}</tool_call>'),
    ("tool", "d12: Vexhollow Dynamics — The Marrowgate plant opened in 1987.\nd40: Marrowgate — A river town.\nd07: Perel Foundry — Founded by Ana Perel."),
    ("assistant", '<tool_call>{"name": "read", "arguments": {"doc_id": "d12"}}</tool_call>'),
    ("answer", "The plant opened in 1987; the project was led by Ana Perel."),
]


def _messages(n: int) -> pa.Array:
    roles = [r if r != "answer" else "assistant" for r, _ in CONTENTS]
    contents = [c for _, c in CONTENTS]
    k = len(CONTENTS)
    call = pa.array([[], [], [{"id": "call_0_0", "name": "search", "arguments": '{"query": "Vexhollow"}'}], [],
                     [{"id": "call_1_0", "name": "read", "arguments": '{"doc_id": "d12"}'}], []],
                    type=MESSAGE.field("tool_calls").type)
    one = pa.StructArray.from_arrays(
        [pa.array(roles), pa.array(contents), call,
         pa.array([None, None, None, "call_0_0", None, None]), pa.array([None, None, None, "search", None, None])],
        fields=list(MESSAGE),
    )
    idx = pa.array(np.tile(np.arange(k), n))
    flat = one.take(idx)
    return pa.ListArray.from_arrays(pa.array(np.arange(0, n * k + 1, k, dtype=np.int32)), flat)


def _lists(lengths: np.ndarray, values: np.ndarray, typ: pa.DataType) -> pa.Array:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=typ))


def rollout_batch(batch_id: str, n: int, rng: np.random.Generator) -> pa.Table:
    lengths = rng.integers(250, 350, n)  # ~300 tokens per episode
    total = int(lengths.sum())
    prompt_len = 120
    pos = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    mask = (pos >= prompt_len).astype(np.int8)
    logprobs = (-rng.exponential(0.7, total).astype(np.float32)) * mask
    ids = np.array([f"{batch_id}-{i:06d}" for i in range(n)])
    groups = np.array([f"{batch_id}-g{i // 8:05d}" for i in range(n)])
    ts = pa.array(np.full(n, np.datetime64("2026-11-29T03:00:00", "us")), type=pa.timestamp("us")).cast(ROLLOUTS.field("created_at").type)
    cols = {
        "rollout_id": pa.array(ids), "batch_id": pa.array([batch_id] * n), "policy_id": pa.array(["ck-parent"] * n),
        "task": pa.array(["doc_search"] * n), "split": pa.array(["train"] * n),
        "prompt_id": pa.array([f"q{i // 8 % 120}" for i in range(n)]), "group_id": pa.array(groups),
        "sample_idx": pa.array((np.arange(n) % 8).astype(np.int32)), "messages": _messages(n),
        "token_ids": _lists(lengths, rng.integers(0, 49152, total, dtype=np.int32), pa.int32()),
        "num_tokens": pa.array(lengths.astype(np.int32)),
        "loss_mask": _lists(lengths, mask, pa.int8()), "behavior_logprobs": _lists(lengths, logprobs, pa.float32()),
        "segment_starts": pa.array([[]] * n, pa.list_(pa.int32())),
        "image_ids": pa.array([[]] * n, ROLLOUTS.field("image_ids").type),
        "num_turns": pa.array(np.full(n, 3, dtype=np.int32)), "num_tool_calls": pa.array(np.full(n, 2, dtype=np.int32)),
        "finish_reason": pa.array(["answer"] * n), "truncated": pa.array(np.zeros(n, dtype=bool)),
        "metadata": pa.array([json.dumps({"answer": "1987", "answer_doc_id": "d12"})] * n),
        "sampling": pa.array([json.dumps({"temperature": 1.0, "max_new_tokens": 64})] * n),
        "seed": pa.array(np.arange(n, dtype=np.int64)), "gen_seconds": pa.array(rng.random(n) * 3),
        "created_at": ts, "schema_version": pa.array(np.full(n, SCHEMA_VERSION, dtype=np.int32)),
    }
    return pa.table(cols, schema=ROLLOUTS)


def reward_batch(batch_id: str, ids: pa.Array, version: str, values: np.ndarray) -> pa.Table:
    n = len(ids)
    score_id = f"rw-{batch_id}-{version}"
    ts = pa.array(np.full(n, np.datetime64("2026-11-29T03:00:00", "us")), type=pa.timestamp("us")).cast(REWARDS.field("scored_at").type)
    return pa.table({
        "rollout_id": ids, "batch_id": pa.array([batch_id] * n), "reward_name": pa.array(["correct"] * n),
        "reward_version": pa.array([version] * n), "value": pa.array(values), "details": pa.array([None] * n, pa.string()),
        "error": pa.array([None] * n, pa.string()), "score_batch_id": pa.array([score_id] * n),
        "scored_at": ts, "schema_version": pa.array(np.full(n, SCHEMA_VERSION, dtype=np.int32)),
    }, schema=REWARDS)


QUERIES = {
    "mean reward by step": """
        SELECT CAST(a.meta->>'step' AS INTEGER) AS step, avg(r.value) AS mean_reward
        FROM rewards r JOIN artifacts a ON a.artifact_id = r.batch_id
        WHERE r.reward_version = 'v1' GROUP BY 1 ORDER BY 1""",
    "per-group reward std": """
        SELECT group_id, stddev_pop(value) AS std FROM rollouts JOIN rewards USING (rollout_id)
        WHERE reward_version = 'v1' GROUP BY group_id ORDER BY std DESC, group_id LIMIT 20""",
    "top-10 longest episodes": """
        SELECT rollout_id, num_tokens, num_turns FROM rollouts ORDER BY num_tokens DESC LIMIT 10""",
    "top-10 longest episodes, decoding token lists (for comparison)": """
        SELECT rollout_id, len(token_ids) AS tokens FROM rollouts ORDER BY tokens DESC LIMIT 10""",
    "reward disagrees across versions": """
        SELECT count(*) AS n FROM rewards a JOIN rewards b USING (rollout_id)
        WHERE a.reward_version = 'v1' AND b.reward_version = 'v2' AND a.value IS DISTINCT FROM b.value""",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=10_000)
    ap.add_argument("--workspace", default="/tmp/rlops-bench")
    args = ap.parse_args()
    shutil.rmtree(args.workspace, ignore_errors=True)
    ws = Workspace.open(args.workspace)
    rng = np.random.default_rng(0)

    gen_s = write_s = 0.0
    for step in range(args.rows // args.batch):
        batch_id = f"ro-{step:05d}"
        t0 = time.perf_counter()
        table = rollout_batch(batch_id, args.batch, rng)
        v1 = (rng.random(args.batch) < 0.3).astype(np.float64)
        v2 = np.where(rng.random(args.batch) < 0.05, 1 - v1, v1)
        rewards = [reward_batch(batch_id, table["rollout_id"], v, vals) for v, vals in (("v1", v1), ("v2", v2))]
        t1 = time.perf_counter()
        ws.write_part("rollouts", batch_id, table, part="part-00000")
        ws.catalog.complete_artifact(batch_id, "rollouts", "rollout", [], "bench", meta={"step": step})
        for r in rewards:
            sid = r["score_batch_id"][0].as_py()
            ws.write_part("rewards", sid, r, part="part-00000")
            ws.catalog.complete_artifact(sid, "rewards", "score", [batch_id], "bench")
        gen_s += t1 - t0
        write_s += time.perf_counter() - t1
    data_bytes = sum(p.stat().st_size for p in Path(ws.settings.data_root).rglob("*.parquet"))
    roll_bytes = sum(p.stat().st_size for p in (Path(ws.settings.data_root) / "rollouts").rglob("*.parquet"))
    print(f"rows: {args.rows:,} rollouts + {2 * args.rows:,} reward rows in {args.rows // args.batch} batches")
    print(f"write (Parquet zstd + fsync + rename + catalog): {write_s:.1f} s  (data generation, not counted: {gen_s:.1f} s)")
    print(f"bytes on disk: rollouts {roll_bytes / 1e9:.2f} GB, all data {data_bytes / 1e9:.2f} GB")

    t0 = time.perf_counter()
    sandbox = Sandbox(ws.settings)
    print(f"sandbox open (views over {len(ws.catalog.artifacts())} artifacts): {time.perf_counter() - t0:.2f} s")
    for name, sql in QUERIES.items():
        sandbox.query(sql)  # warm the OS page cache once; report the second run
        t0 = time.perf_counter()
        out = sandbox.query(sql)
        print(f"query {name!r}: {time.perf_counter() - t0:.3f} s ({out.num_rows} rows)")

    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        subprocess.run([str(Path(sys.executable).parent / "rlops"), "--help"], check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    print(f"rlops --help cold start: median {sorted(times)[2]:.3f} s over 5 runs")


if __name__ == "__main__":
    loopback.enter()
    main()
