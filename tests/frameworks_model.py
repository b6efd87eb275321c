"""A tiny model that has memorised a tool-using conversation under a framework's own long system prompt.

tests/scripted_model.py memorises the scripted conversation under a one-line system prompt; a framework
that wraps the conversation in its own long prompt (smolagents' ToolCallingAgent: ~1000 tokens of rules
and examples) gets nothing useful from that model. This trains the same tiny architecture on the
conversation exactly as the service will see it, computing the logits only where the loss is (the
assistant turns), so a prompt of a thousand tokens still trains in seconds on CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def train_turns(model_dir: Path, out: Path, messages: list[dict[str, Any]], steps: int = 150,
                lr: float = 1e-2) -> Path:
    """Train a copy of the tiny model at `model_dir` until greedy decoding reproduces the assistant turns
    of `messages` (OpenAI shape, tool calls written as `<tool_call>` text, as the service renders them);
    save it to `out`."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids: list[int] = []
    targets: dict[int, int] = {}  # position -> the token to predict there (the next one)
    for k in (i for i, m in enumerate(messages) if m["role"] == "assistant"):
        prompt = tok.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)
        ids += tok(prompt, add_special_tokens=False)["input_ids"][len(ids):]
        turn = tok(messages[k]["content"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
        targets.update({len(ids) - 1 + j: t for j, t in enumerate(turn)})
        ids += turn + tok("\n", add_special_tokens=False)["input_ids"]  # the template's newline after <|im_end|>
    ids_t = torch.tensor([ids])  # (1, T)
    where = torch.tensor(sorted(targets))  # (N,)
    labels = torch.tensor([targets[p] for p in sorted(targets)])  # (N,)
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        hidden = model.model(input_ids=ids_t).last_hidden_state[0, where]  # (N, H): only where the loss is
        loss = F.cross_entropy(model.lm_head(hidden), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out
