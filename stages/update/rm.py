"""A learned reward model: `RMConfig` and `train_rm`, a Bradley-Terry head trained from preference pairs.

    critic = load_value_model(base_model, None, config.lora)      # LoRA on the base decoder + a scalar head
    history = train_rm(critic, pairs, config)                     # -log sigmoid(r(chosen) - r(rejected))
    save_value_model(critic, folder)                              # the rm checkpoint: adapter + head.pt

The pairs are DPO's (stages/update/pairs.py): two episodes of one group whose rewards differ, or which a person
ordered (`rlops review`, the `human` reward). An episode's score is the head's value at its last token, after the
whole conversation (prompt, completion, tool results). `rewards.rm.learned` scores with the trained checkpoint.

torch, transformers and peft are imported inside functions: importing this module is cheap.
"""

from __future__ import annotations

import random
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stages.policy.lora import LoRASettings
from stages.update.pairs import Pairing, PreferencePair


class RMConfig(BaseModel):
    """One reward model trained on the pairs of some scored batches. Every field enters the checkpoint's id."""

    model_config = ConfigDict(extra="forbid")

    lr: float = 1e-4  # the adapter's
    head_lr: float = 1e-3  # the head starts at 0: it needs a faster rate (as PPO's critic)
    epochs: int = Field(2, ge=1)  # passes over the pairs, in a seeded order
    micro_batch_size: int = Field(8, ge=1)  # pairs per optimizer step
    pairing: Pairing = "all"  # every ordered pair of a group with different rewards (or "best_worst")
    min_margin: float = Field(0.0, ge=0)
    seed: int = 0  # the order of the pairs
    max_grad_norm: float = 1.0
    lora: LoRASettings = Field(default_factory=LoRASettings)


def episode_scores(critic: Any, sequences: list[list[int]]) -> Any:
    """(n,) the critic's value at the last token of each sequence (right-padded in one forward pass)."""
    import torch

    device = next(critic.parameters()).device
    T = max(len(s) for s in sequences)
    ids, attn = torch.zeros(len(sequences), T, dtype=torch.long), torch.zeros(len(sequences), T, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, :len(s)], attn[i, :len(s)] = torch.tensor(s), 1
    values = critic(ids.to(device), attn.to(device))  # (n, T)
    last = torch.tensor([len(s) - 1 for s in sequences], device=device)
    return values[torch.arange(len(sequences), device=device), last]


def _sequences(pair: PreferencePair) -> tuple[list[int], list[int]]:
    return pair.prompt_ids + pair.chosen_ids, pair.prompt_ids + pair.rejected_ids


def train_rm(critic: Any, pairs: list[PreferencePair], config: RMConfig) -> list[dict[str, float]]:
    """`config.epochs` passes of the Bradley-Terry loss over `pairs`, one AdamW step per micro-batch of pairs;
    returns one row per epoch: loss, accuracy (chosen scored above rejected) and mean margin, over the epoch."""
    import torch
    import torch.nn.functional as F

    head = list(critic.head.parameters())
    adapter = [p for n, p in critic.named_parameters() if p.requires_grad and not n.startswith("head.")]
    optimizer = torch.optim.AdamW([{"params": adapter, "lr": config.lr}, {"params": head, "lr": config.head_lr}],
                                  weight_decay=0.0)
    critic.train()
    order, history = list(range(len(pairs))), []
    for epoch in range(config.epochs):
        random.Random(f"{config.seed}:{epoch}").shuffle(order)
        loss_sum = correct = margin = 0.0
        for start in range(0, len(order), config.micro_batch_size):
            chunk = [pairs[i] for i in order[start:start + config.micro_batch_size]]
            chosen, rejected = zip(*(_sequences(p) for p in chunk))
            scores = episode_scores(critic, [*chosen, *rejected])
            diff = scores[:len(chunk)] - scores[len(chunk):]
            loss = -F.logsigmoid(diff).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(adapter + head, config.max_grad_norm)
            optimizer.step()
            loss_sum += float(loss.detach()) * len(chunk)
            correct += float((diff > 0).sum())
            margin += float(diff.detach().sum())
        n = max(len(pairs), 1)
        history.append({"loss": loss_sum / n, "accuracy": correct / n, "margin": margin / n})
    critic.eval()
    return history
