"""PPO with a learned critic: `PPOConfig`, the value model, and `train_ppo`.

    critic = load_value_model(base_model, value_dir, config.lora)      # LoRA on the same base + a scalar head
    history = train_ppo(policy, critic, episodes, config, temperature=1.0)
    save_value_model(critic, folder / "value")                          # beside the policy's adapter

The critic is a second copy of the base model's decoder with its own LoRA adapter and a linear head
(hidden -> 1): separate weights, so the policy's adapter and the critic's never share an update, at the
memory cost of a second base model (measured by bench/bench_algorithms.py). Each PPO epoch: the critic's
values at the steps (stages/update/gae.py: tokens or assistant turns) -> GAE advantages (whitened over the
batch) and returns -> the clipped policy loss on every sampled token + the critic's squared error on the
returns, one AdamW step over both adapters and the head.

torch, transformers and peft are imported inside functions: importing this module is cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stages.policy.lora import LORA_SEED, LoRASettings
from stages.policy.model import resolve_model
from stages.update.config import Credit


class PPOConfig(BaseModel):
    """One PPO update on scored batches. Every field enters the checkpoint's id."""

    model_config = ConfigDict(extra="forbid")

    credit: Credit = "turn"  # a step per assistant turn (a value at each turn boundary); "token": per token
    gamma: float = 1.0  # no discount: an episode is short and only its outcome is rewarded
    lam: float = 0.95  # GAE's lambda, the usual PPO-for-LLMs value (verl, OpenRLHF)
    lr: float = 1e-4  # as GRPO's, for both adapters
    value_lr: float = 1e-3  # the critic's head starts from scratch: it needs a faster rate than the adapters
    epochs: int = Field(2, ge=1)  # passes over the batch; the critic learns from each
    eps: float = 0.2  # PPO's clip
    value_coef: float = 0.5  # the critic's loss weight (PPO paper's c1)
    max_grad_norm: float = 1.0
    micro_batch_size: int = Field(8, ge=1)  # sequences per forward/backward
    lora: LoRASettings = Field(default_factory=LoRASettings)  # the policy's (parent without adapter) and the critic's


@dataclass(frozen=True)
class Episode:
    """One rollout as PPO sees it."""

    token_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    reward: float


def _value_class() -> type:
    import torch

    class ValueModel(torch.nn.Module):
        """A LoRA-adapted decoder and a scalar head: values (B, T), one per position's hidden state."""

        def __init__(self, backbone: Any, hidden: int):
            super().__init__()
            self.backbone = backbone
            self.head = torch.nn.Linear(hidden, 1)
            torch.nn.init.zeros_(self.head.weight)  # every value starts at 0 (the bias): no random credit
            torch.nn.init.zeros_(self.head.bias)

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            h = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, H)
            return self.head(h).squeeze(-1)  # (B, T)

    return ValueModel


def load_value_model(base_model: str, value_dir: Path | None, lora: LoRASettings) -> Any:
    """The critic: the base decoder (no LM head) with a LoRA adapter and a head; from `value_dir` if the
    parent checkpoint has one (the critic continues), else fresh (head at 0)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    backbone = AutoModel.from_pretrained(resolve_model(base_model), dtype=torch.float32)
    if value_dir is not None and (value_dir / "adapter_config.json").exists():
        backbone = PeftModel.from_pretrained(backbone, value_dir, is_trainable=True)
    else:  # the policy's LoRA settings, without the causal-LM wrapper (the backbone has no LM head)
        from peft import get_peft_model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(LORA_SEED)
            peft_config = lora.peft_config()
            peft_config.task_type = None
            backbone = get_peft_model(backbone, peft_config)
    critic = _value_class()(backbone, backbone.config.hidden_size)
    if value_dir is not None and (value_dir / "head.pt").exists():
        critic.head.load_state_dict(torch.load(value_dir / "head.pt", map_location="cpu", weights_only=True))
    return critic.to(device)


def save_value_model(critic: Any, folder: Path) -> None:
    """The critic's adapter and head into `folder` (the checkpoint's `value/`)."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    critic.backbone.save_pretrained(folder, safe_serialization=True)
    torch.save(critic.head.state_dict(), folder / "head.pt")


def _pad(rows: list[list[float]], dtype: Any, device: Any) -> Any:
    import torch

    out = torch.zeros(len(rows), max(len(r) for r in rows), dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out.to(device)


def _step_values(values: Any, positions: list[int]) -> Any:
    """(T,) values by position -> (S,) the value of each step: read at the position before it."""
    import torch

    return values[torch.tensor([p - 1 for p in positions], dtype=torch.long, device=values.device)]


def train_ppo(policy: Any, critic: Any, episodes: list[Episode], config: PPOConfig,
              temperature: float) -> list[dict[str, float]]:
    """`config.epochs` PPO steps on `episodes`; returns per epoch: loss, policy_loss, value_loss (the critic's
    mean squared error on that epoch's returns, before its step), explained_variance (1 - Var(returns - values)
    / Var(returns) over the steps, before its step: 1 a perfect critic, 0 no better than a constant),
    advantage_std, grad_norm, tokens."""
    import torch

    from stages.policy.logprobs import token_logprobs
    from stages.update.gae import clipped_token_loss, episode_advantages, step_positions

    device = next(policy.parameters()).device
    params = [{"params": [p for p in policy.parameters() if p.requires_grad], "lr": config.lr},
              {"params": [p for n, p in critic.named_parameters() if p.requires_grad and not n.startswith("head")],
               "lr": config.lr},
              {"params": list(critic.head.parameters()), "lr": config.value_lr}]
    optimizer = torch.optim.AdamW(params, weight_decay=0.0)
    order = sorted(range(len(episodes)), key=lambda i: len(episodes[i].token_ids))
    chunks = [order[i:i + config.micro_batch_size] for i in range(0, len(order), config.micro_batch_size)]
    positions = [step_positions(e.loss_mask, config.credit) for e in episodes]
    tokens = float(sum(sum(e.loss_mask) for e in episodes))
    history = []
    for _ in range(config.epochs):
        # The critic's values at the steps (no grad) -> advantages and returns for this epoch.
        advantages, returns = [None] * len(episodes), [None] * len(episodes)
        step_values = [None] * len(episodes)
        critic.eval()
        with torch.no_grad():
            for idx in chunks:
                ids = _pad([episodes[i].token_ids for i in idx], torch.long, device)
                attn = _pad([[1] * len(episodes[i].token_ids) for i in idx], torch.long, device)
                values = critic(ids, attn).float().cpu()  # (b, T)
                for row, i in enumerate(idx):
                    v = step_values[i] = _step_values(values[row], positions[i])
                    advantages[i], returns[i] = episode_advantages(episodes[i].reward, v, episodes[i].loss_mask,
                                                                   config.credit, config.gamma, config.lam)
        # Whiten the advantages over the batch's sampled tokens (PPO's usual normalisation).
        flat = torch.cat([a[torch.tensor(e.loss_mask, dtype=torch.bool)] for a, e in zip(advantages, episodes)])
        mean, std = flat.mean(), flat.std(unbiased=False) + 1e-6
        all_returns, all_values = torch.cat(returns), torch.cat(step_values)
        ret_var = float(all_returns.var(unbiased=False))
        explained = 1.0 - float((all_returns - all_values).var(unbiased=False)) / ret_var if ret_var > 0 else 0.0
        policy.train()
        critic.train()
        optimizer.zero_grad(set_to_none=True)
        sums = {"policy_loss": 0.0, "value_loss": 0.0}
        n_steps = float(sum(len(p) for p in positions))
        for idx in chunks:
            ids = _pad([episodes[i].token_ids for i in idx], torch.long, device)
            attn = _pad([[1] * len(episodes[i].token_ids) for i in idx], torch.long, device)
            mask = _pad([episodes[i].loss_mask for i in idx], torch.long, device).bool()
            mask[:, 0] = False
            blp = _pad([episodes[i].behavior_logprobs for i in idx], torch.float32, device)
            adv = (_pad([advantages[i].tolist() for i in idx], torch.float32, device) - mean) / std
            logp = token_logprobs(policy, ids, attn, mask, temperature)  # (b, T)
            n = float(mask.sum())
            pl = clipped_token_loss(logp, blp, adv, mask, config.eps) * (n / tokens)
            values = critic(ids, attn)  # (b, T)
            vl = sum(((_step_values(values[row], positions[i]) - returns[i].to(device)) ** 2).sum()
                     for row, i in enumerate(idx)) / n_steps
            (pl + config.value_coef * vl).backward()
            sums["policy_loss"] += float(pl.detach())
            sums["value_loss"] += float(vl.detach())
        grad_norm = float(torch.nn.utils.clip_grad_norm_([p for g in params for p in g["params"]], config.max_grad_norm))
        optimizer.step()
        history.append({**sums, "loss": sums["policy_loss"] + config.value_coef * sums["value_loss"],
                        "explained_variance": explained, "advantage_std": float(std), "grad_norm": grad_norm, "tokens": tokens})
    return history
