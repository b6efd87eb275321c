"""The tables of the deployment loop (docs/LOOP.md): what `rlops serve` answered, what people said of it, and what
the label-free gate's judge said of champion and challenger. Part of the one schema module: storage/schema.py
imports them into `TABLES`, so each is a Parquet kind under the data root with a SQL view of its name.

Rows are plain dicts (`pa.Table.from_pylist(rows, schema=TABLES["traffic"])`): a served call is written once and
never read back as a record, so no dataclass mirrors these the way `Rollout` mirrors `rollouts`. The schemas are
built from schema.py's message and timestamp types (`loop_tables`), so the two modules never import each other.
"""

from __future__ import annotations

import pyarrow as pa


def loop_tables(message: pa.DataType, ts: pa.DataType) -> dict[str, pa.Schema]:
    """The loop's Parquet kinds, with `message` (schema.MESSAGE) and `ts` (schema.TS) as schema.py defines them."""
    return {"traffic": traffic(message, ts), "feedback": feedback(ts), "verdicts": verdicts(ts)}


# One row per call `rlops serve` answered (chat completions, completions, Responses, Messages; streamed or not).
def traffic(message: pa.DataType, ts: pa.DataType) -> pa.Schema:
    return pa.schema([
        ("call_id", pa.string()),  # the response's id (chatcmpl-..., resp_..., msg_...): unique per call
        ("served_at", ts),  # when the request arrived
        ("latency_s", pa.float64()),  # arrival to the last byte of the answer (a stream's end)
        ("api", pa.string()),  # chat | completions | responses | messages
        ("stream", pa.bool_()),
        ("episode_id", pa.string()),  # the URL's /ep/{id}, else X-Episode-Id, else `user` (null: none)
        ("session_id", pa.string()),  # X-Session-Id, else metadata.session_id, else the episode id
        ("user_id", pa.string()),  # X-User-Id, else metadata.user_id, else `user` (null: anonymous)
        ("model", pa.string()),  # what the request named: `base`, a checkpoint id, NAME@ALIAS, models:/...
        ("policy_id", pa.string()),  # the checkpoint that answered
        ("registry_model", pa.string()),  # when `model` named a registered model: its name, alias and version
        ("registry_alias", pa.string()),
        ("registry_version", pa.string()),
        # The conversation as the model saw it: the client's messages, tools written into the system message, and
        # the service's own earlier turns of the episode as their raw sampled text (what a re-sample starts from).
        ("messages", pa.list_(message)),
        ("tools", pa.string()),  # JSON: the function tools the request offered (null: none)
        ("reply", pa.string()),  # what the first choice said: the raw sampled text (tool calls in their tags)
        ("reply_tool_calls", pa.int32()),  # how many tool calls the reply holds
        ("finish_reason", pa.string()),  # stop | length | tool_calls
        ("n", pa.int32()),  # choices asked; the token columns are the first choice's
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("token_ids", pa.list_(pa.int32())),  # sampled, EOS included when the model emitted it
        ("logprobs", pa.list_(pa.float32())),  # behaviour log-prob of each sampled token
        ("prompt_tokens", pa.int32()),
        ("completion_tokens", pa.int32()),
        ("sampling", pa.string()),  # JSON: temperature, top_p, max_tokens, seed as the call was sampled
        ("tags", pa.string()),  # JSON object: the request's `metadata` and the X-Rlops-Tags header, as the client sent them
        # Content keys (storage/traffic.py `content_key`): the conversation, and its first user message, normalised
        # (case, whitespace) and hashed. The traffic task's scenario ids; the join from a person's calls to the
        # rollouts re-sampled from them (`rollouts.prompt_id`), so SQL can say which checkpoints saw their data.
        ("scenario_id", pa.string()),
        ("input_id", pa.string()),
        ("server_id", pa.string()),  # the `rlops serve` process that recorded it
        ("schema_version", pa.int32()),
    ])


# One row per piece of feedback sent to POST /rlops/episodes/{id}/feedback (LangSmith's and Langfuse's fields).
def feedback(ts: pa.DataType) -> pa.Schema:
    return pa.schema([
        ("feedback_id", pa.string()),
        ("episode_id", pa.string()),
        ("call_id", pa.string()),  # the call it is about (null: the episode as a whole)
        ("key", pa.string()),  # what is scored ("correctness", "thumbs"; LangSmith's key, Langfuse's name)
        ("score", pa.float64()),  # in [0, 1] (null: a label or comment only)
        ("label", pa.string()),  # a categorical value ("good", "wrong tool")
        ("comment", pa.string()),
        ("who", pa.string()),  # who gave it: a user, a reviewer, a program
        ("created_at", ts),
        ("server_id", pa.string()),
        ("schema_version", pa.int32()),
    ])


# One row per held-out scenario of a label-free gate (stages/judge_gate.py): champion and challenger answered it
# greedily, a pairwise judge compared the answers in both orders.
def verdicts(ts: pa.DataType) -> pa.Schema:
    return pa.schema([
        ("comparison_id", pa.string()),  # the verdicts artifact: (both answer batches, the judge's version)
        ("prompt_id", pa.string()),  # the scenario
        ("champion", pa.string()),  # policy ids
        ("challenger", pa.string()),
        ("champion_rollout", pa.string()),
        ("challenger_rollout", pa.string()),
        ("p_challenger_first", pa.float64()),  # P(challenger better) with the challenger shown first
        ("p_challenger_second", pa.float64()),  # ... shown second
        # The gate's yes_no mode judges each answer alone: P(it achieves its goal), the champion's and the challenger's.
        ("p_champion", pa.float64()),
        ("p_challenger", pa.float64()),
        ("win", pa.float64()),  # the challenger's win probability: pairwise, the two orders' mean (position bias
        # cancelled); yes_no, 0.5 + (p_challenger - p_champion) / 2; identical answers 0.5, the judge not asked
        ("error", pa.string()),  # why the judge gave no verdict (then the p columns are null)
        ("judge_model", pa.string()),
        ("judge_version", pa.string()),
        ("created_at", ts),
        ("schema_version", pa.int32()),
    ])
