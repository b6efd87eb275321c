"""A tiny model that has memorised one tool-using conversation, so tests see real tool calls.

The random tiny model of tests/conftest.py never writes a `<tool_call>`; this one is the same
architecture trained (~4 s of CPU) until greedy decoding reproduces the scripted
assistant turns: a `search` call, then the answer after the tool's result. Everything around it
(templates, tokens, log-probs, the service) is real.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.built_once import built_once

SYSTEM = "You answer questions with the tools."
QUESTION = "When was Vexhollow Dynamics founded?"
CALL = {"name": "search", "arguments": {"query": "Vexhollow"}}
TOOL_RESULT = "d12: Vexhollow Dynamics was founded in 1987."
ANSWER = "1987"
TOOLS: list[dict[str, Any]] = [{
    "type": "function",
    "function": {"name": "search", "description": "Search the knowledge base.",
                 "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}},
}]


def script_messages(call_id: str = "call_0") -> list[dict[str, Any]]:
    """The scripted conversation in the OpenAI shape, as the service renders it (tools in the system message)."""
    from tasks.base import render_system_prompt

    return [
        {"role": "system", "content": render_system_prompt(SYSTEM, TOOLS)},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": f"<tool_call>{json.dumps(CALL)}</tool_call>"},
        {"role": "tool", "content": TOOL_RESULT, "tool_call_id": call_id},
        {"role": "assistant", "content": ANSWER},
    ]


def labelled_loss(model: Any, ids: list[int], labels: list[int], **inputs: Any) -> Any:
    """The causal LM loss of one sequence over its labelled tokens (-100 elsewhere), as `model(labels=...)`
    computes it, with the vocabulary projection applied only at the positions that predict them
    (`logits_to_keep`): for the tiny models the projection onto a 49k-token vocabulary is nearly all of a
    training step, and most positions are prompt."""
    import torch

    at = torch.tensor([i for i in range(len(ids) - 1) if labels[i + 1] != -100])
    logits = model(input_ids=torch.tensor([ids]), logits_to_keep=at, **inputs).logits
    return torch.nn.functional.cross_entropy(logits.reshape(len(at), -1), torch.tensor(labels)[at + 1])


def conversation_tokens(tok: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """(token ids, labels) of a conversation as one sequence: the labels are the assistant turns' tokens (with
    their <|im_end|>), -100 elsewhere."""
    ids: list[int] = []
    labels: list[int] = []
    for k in (i for i, m in enumerate(messages) if m["role"] == "assistant"):
        prompt = tok.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)
        p = tok(prompt, add_special_tokens=False)["input_ids"][len(ids):]
        a = tok(messages[k]["content"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
        ids += p + a
        labels += [-100] * len(p) + a
        ids += tok("\n", add_special_tokens=False)["input_ids"]  # the template's newline after <|im_end|>
        labels += [-100]
    return ids, labels


def train_scripted(model_dir: Path, out: Path, steps: int = 150, lr: float = 1e-2,
                   messages: list[dict[str, Any]] | None = None) -> Path:
    """Train a copy of the tiny model at `model_dir` on the scripted conversation (or on `messages`, another
    conversation in the same shape); save it to `out`."""
    return train_mixed(model_dir, out, [(messages or script_messages(), 1.0)], steps=steps, lr=lr)


def train_mixed(model_dir: Path, out: Path, conversations: list[tuple[list[dict[str, Any]], float]], steps: int,
                lr: float = 1e-2) -> Path:
    """Train a copy of the tiny model at `model_dir` on several conversations at once, each loss weighted: its first
    answer token tends to the weights' mixture (it barely reads the question yet). Saved to `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokens = [(conversation_tokens(tok, messages), weight) for messages, weight in conversations]
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        loss = sum(weight * labelled_loss(model, ids, labels) for (ids, labels), weight in tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def scripted_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model folder whose greedy answer to the scripted question is the scripted tool call (trained
    once per test run: every xdist worker reads the same folder)."""
    return built_once(tmp_path_factory, "scripted", lambda out: train_scripted(tiny_model_dir, out))
