"""Hand-built records for tests: realistic multi-turn tool episodes, no model needed."""

from __future__ import annotations

import random

from storage.schema import Message, RewardRow, Rollout, ToolCall


def tool_episode(batch_id: str, group: int, sample: int, answer: str = "1987") -> Rollout:
    """A doc_search-like episode: search call, tool result, read call, tool result, final answer."""
    rng = random.Random(group * 100 + sample)
    messages = [
        Message("system", "You answer questions using the tools."),
        Message("user", "When was Vexhollow Dynamics founded?"),
        Message("assistant", '<tool_call>{"name": "search", "arguments": {"query": "Vexhollow founded"}}</tool_call>',
                tool_calls=[ToolCall("call_0_0", "search", '{"query": "Vexhollow founded"}')]),
        Message("tool", "d12: Vexhollow Dynamics — founded in 1987", tool_call_id="call_0_0", name="search"),
        Message("assistant", '<tool_call>{"name": "read", "arguments": {"doc_id": "d12"}}</tool_call>',
                tool_calls=[ToolCall("call_1_0", "read", '{"doc_id": "d12"}')]),
        Message("tool", "Vexhollow Dynamics was founded in 1987 by Ana Perel.", tool_call_id="call_1_0", name="read"),
        Message("assistant", answer),
    ]
    n = rng.randint(40, 80)
    mask = [0] * 20 + [1] * (n - 20)
    return Rollout(
        rollout_id=f"{batch_id}-g{group}-s{sample}",
        batch_id=batch_id,
        policy_id="base",
        task="doc_search",
        split="train",
        prompt_id=f"q{group}",
        group_id=f"{batch_id}-g{group}",
        sample_idx=sample,
        messages=messages,
        token_ids=[rng.randrange(49152) for _ in range(n)],
        loss_mask=mask,
        behavior_logprobs=[-rng.random() if m else 0.0 for m in mask],
        num_turns=3,
        num_tool_calls=2,
        finish_reason="answer",
        truncated=False,
        metadata={"answer": "1987", "answer_doc_id": "d12"},
        sampling={"temperature": 1.0, "max_new_tokens": 32},
        seed=group * 100 + sample,
        gen_seconds=0.5,
    )


def reward_rows(rollouts: list[Rollout], name: str, version: str, score_batch_id: str) -> list[RewardRow]:
    return [
        RewardRow(r.rollout_id, r.batch_id, name, version, float(r.messages[-1].content == "1987"), {"k": 1}, None,
                  score_batch_id)
        for r in rollouts
    ]


def served_call(i: int, question: str | None = None, *, episode: str | None = None, session: str | None = None,
                user: str | None = None, at: float | None = None, system: str = "Be brief.") -> dict:
    """A `traffic` row as `rlops serve` writes one (stages/service/served.py), for call `i`: a question (default
    "What is i + 1?") answered at T0 + `at` (default i) seconds, in its own episode and session unless given."""
    from datetime import timedelta

    from storage.traffic import content_key, input_key

    def message(role: str, content: str) -> dict:
        return {"role": role, "content": content, "tool_calls": [], "tool_call_id": None, "name": None}

    messages = [message("system", system), message("user", question or f"What is {i} + 1?")]
    episode = episode or f"ep-{i}"
    return {"call_id": f"chatcmpl-{i}", "served_at": SERVED_T0 + timedelta(seconds=i if at is None else at),
            "latency_s": 0.1, "api": "chat", "stream": False, "episode_id": episode, "session_id": session or episode,
            "user_id": user, "model": "base", "policy_id": "base", "messages": messages, "reply": str(i + 1),
            "reply_tool_calls": 0, "finish_reason": "stop", "n": 1, "prompt_token_ids": [1, 2, 3], "token_ids": [4, 2],
            "logprobs": [-0.5, -0.1], "prompt_tokens": 3, "completion_tokens": 2, "scenario_id": content_key(messages),
            "input_id": input_key(messages)}


def _t0():
    from datetime import datetime, timezone

    return datetime(2026, 12, 1, tzinfo=timezone.utc)


SERVED_T0 = _t0()  # when `served_call` rows start
