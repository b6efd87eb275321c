"""One rank's part of a data-parallel GRPO update, and how the batch is cut into shards.

    parts = shards(samples, advantages, workers=2, aggregation="token_mean")   # the driver: one dict per rank
    optimizer, history = train_shard(model, common, parts[rank], device)       # each rank, in its process group

Used by the driver (stages/update/workers.py) and by the update worker group's ranks (stages/update/group.py);
why the shards' summed gradients equal the whole batch's is workers.py's docstring.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from stages.update.config import GRPOConfig
from stages.update.data import Sample
from stages.update.train import train_on_batch

if TYPE_CHECKING:
    import torch

TOKEN_STATS = ("clip_frac_low", "clip_frac_high", "ratio_mean", "kl", "is_weight_mean", "is_masked_frac",
               "entropy", "teacher_kl")  # token-weighted means in train_on_batch


def autocast(device: Any) -> Any:
    """bf16 autocast on CUDA (the LoRA and base weights stay fp32); nothing on CPU, where bf16 matmuls
    are slower than fp32 without AMX (DESIGN.md)."""
    import torch

    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def scored_tokens(s: Sample) -> int:
    """Tokens the loss averages over: sampled ones, except position 0 (nothing predicts it)."""
    return sum(s.loss_mask[1:])


def shard_weight(shard: list[Sample], batch: list[Sample], aggregation: str) -> float:
    """The factor turning a shard's `train_on_batch` gradient into its part of the whole batch's gradient."""
    if aggregation == "token_mean":  # mean over tokens: the shard's share of the tokens
        return sum(map(scored_tokens, shard)) / sum(map(scored_tokens, batch))
    weight = len(shard) / len(batch)  # seq_mean: mean over sequences
    if aggregation == "dr_grpo":  # a constant normaliser: the longest completion, of the shard vs of the batch
        weight *= max(sum(s.loss_mask) for s in shard) / max(sum(s.loss_mask) for s in batch)
    return weight


class AllReduceStep:
    """Stands in for the optimizer inside `train_on_batch` on a DDP worker: `step()` first scales the
    local gradient by the shard's weight and sums it over workers (one flat all-reduce), then clips by
    the global norm and steps the real optimizer. `train_on_batch` runs with max_grad_norm=inf, so its
    own clip is a no-op and the real one happens here, on the summed gradient."""

    def __init__(self, optimizer: Any, params: list[torch.Tensor], weight: float, max_grad_norm: float):
        self.optimizer, self.params, self.weight, self.max_grad_norm = optimizer, params, weight, max_grad_norm
        self.grad_norms: list[float] = []  # global, before clipping: one per step

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        import torch
        import torch.distributed as dist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads]) * self.weight  # (sum of LoRA parameter sizes,)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset: offset + n].view_as(p).clone()
            offset += n
        self.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)))
        self.optimizer.step()


def shards(samples: list[Sample], advantages: torch.Tensor, workers: int, aggregation: str) -> list[dict[str, Any]]:
    """Rank r's part of the batch: every `workers`-th sample from r (groups spread over the ranks), its
    advantages, its gradient's weight in the whole batch's (`shard_weight`) and its share of the scored tokens."""
    total = sum(map(scored_tokens, samples))
    out = []
    for rank in range(workers):
        shard = samples[rank::workers]
        out.append({"samples": shard, "advantages": advantages[rank::workers].float().cpu(),  # (len(shard),)
                    "weight": shard_weight(shard, samples, aggregation),
                    "token_share": sum(map(scored_tokens, shard)) / total})
    return out


def train_shard(model: Any, common: dict[str, Any], shard: dict[str, Any], device: Any) -> tuple[Any, list[dict[str, float]]]:
    """One rank's part of a data-parallel update (in an update worker, inside its process group): the driver's
    optimizer state continued over this model's trainable weights, `train_on_batch` on the shard with the
    gradient summed over ranks at each optimizer step (`AllReduceStep`), and the whole batch's metrics (the
    same on every rank). Returns (optimizer, metrics per epoch)."""
    import torch
    import torch.distributed as dist

    config: GRPOConfig = common["config"]
    params = [p for p in model.parameters() if p.requires_grad]  # the driver's optimizer order
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    optimizer.load_state_dict(common["optimizer"])
    step = AllReduceStep(optimizer, params, shard["weight"], config.max_grad_norm)
    with autocast(device):
        history = train_on_batch(model, step, shard["samples"], shard["advantages"],
                                 config.model_copy(update={"max_grad_norm": math.inf}), common["temperature"])
    combined = []
    for m, grad_norm in zip(history, step.grad_norms):
        # Whole-batch metrics: the loss adds up like the gradient; token-weighted means by token share.
        share = shard["token_share"]
        sums = torch.tensor([m["loss"] * shard["weight"], m["tokens"], *(m.get(k, 0.0) * share for k in TOKEN_STATS)],
                            dtype=torch.float64, device=device)
        seconds = torch.tensor([m["tokens"] / m["tokens_per_s"]], dtype=torch.float64, device=device)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the step takes as long as its slowest worker
        loss, tokens, *stats = sums.tolist()
        out = {"loss": loss, **dict(zip(TOKEN_STATS, stats)), "grad_norm": grad_norm, "tokens": tokens,
               "tokens_per_s": tokens / seconds.item()}
        out["clip_frac"] = out["clip_frac_low"] + out["clip_frac_high"]
        if config.beta <= 0:
            out.pop("kl")
        if config.distill is None:
            out.pop("teacher_kl")
        combined.append(out)
    return optimizer, combined


def cpu_state(state: Any) -> Any:
    """An optimizer state dict with every tensor on the CPU: what travels between machines."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.cpu()
    if isinstance(state, dict):
        return {k: cpu_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [cpu_state(v) for v in state]
    return state
