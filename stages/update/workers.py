"""Where a GRPO update runs: in this process, or data-parallel over Ray Train workers.

    history = workers.train(model, optimizer, samples, advantages, config, temperature=1.0, ctx=ctx, base_model=base)

`grpo.workers: 1` runs `stages.update.train.train_on_batch` here (on CUDA under bf16 autocast with the fp32
weights, and with a resident vLLM engine asleep meanwhile). `grpo.workers: N` runs the same function
in N Ray Train `TorchTrainer` workers (torch.distributed: gloo on CPU, NCCL on GPUs), each on a
shard of the samples, on the run's `ray:` cluster or a local Ray. The driver's model and optimizer
state travel to the workers through Ray's object store (no driver-local path is read there), and
the trained adapter and optimizer state come back the same way: the driver writes the checkpoint
once, as for one worker, so the catalog and lineage do not depend on the number of workers.

Why the result equals one worker's: each worker's `train_on_batch` averages the loss over its own
shard (token_mean: its own token count), so before the optimizer step its gradient is scaled by its
shard's share of the batch (`shard_weight`) and summed over workers with one all-reduce per step:
that sum is the gradient of the whole batch's loss. Clipping and the AdamW step then see the same
gradient on every worker, and every worker keeps identical weights. What differs is the order of
floating-point additions (tests: max |Δ| of the adapter weights below 1e-5 after a step).
"""

from __future__ import annotations

import copy

import math
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from stages.update.config import GRPOConfig
from stages.update.data import Sample
from stages.update.train import train_on_batch

if TYPE_CHECKING:
    import torch

    from stages.common import StageContext

TOKEN_STATS = ("clip_frac_low", "clip_frac_high", "ratio_mean", "kl", "is_weight_mean", "is_masked_frac")  # token-weighted means in train_on_batch


def train(model: Any, optimizer: Any, samples: list[Sample], advantages: torch.Tensor, config: GRPOConfig, *,
          temperature: float, ctx: StageContext, base_model: str) -> list[dict[str, float]]:
    """`train_on_batch` (at the samples' sampling `temperature`) with `config.workers` workers; updates
    `model` and `optimizer` in place and returns one metrics dict per epoch (as `train_on_batch`)."""
    from stages.policy.vllm import engines_asleep

    workers = min(config.workers, len(samples))  # every worker needs at least one sample
    # a resident vLLM engine gives its GPU memory to training meanwhile, unless it generates ahead (async run)
    with engines_asleep() if config.sleep_generation else nullcontext():
        if workers <= 1:
            with _autocast(next(model.parameters()).device):
                return train_on_batch(model, optimizer, samples, advantages, config, temperature)
        return _train_distributed(model, optimizer, samples, advantages, config, workers, temperature=temperature,
                                  ctx=ctx, base_model=base_model)


def _autocast(device: Any) -> Any:
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


def _worker_loop(args: dict[str, Any]) -> None:
    """One Ray Train worker: rebuild the driver's model, train on this rank's shard, and (rank 0)
    hand the new trainable weights, optimizer state and whole-batch metrics to the driver's mailbox."""
    import ray
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from stages.policy.model import resolve_model

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    config: GRPOConfig = args["config"]
    base = AutoModelForCausalLM.from_pretrained(resolve_model(args["base_model"]), dtype=torch.float32).to(device)
    model = get_peft_model(base, args["peft_config"])
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    missing = set(trainable) ^ set(args["weights"])
    if missing:
        raise RuntimeError(f"the worker's adapter differs from the driver's: {sorted(missing)[:5]}")
    with torch.no_grad():
        for name, p in trainable.items():
            p.copy_(args["weights"][name])
    params = list(trainable.values())  # the driver's optimizer order: model.parameters() that require grad
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    optimizer.load_state_dict(args["optimizer"])

    samples: list[Sample] = args["samples"]
    shard = samples[rank::world]
    advantages = args["advantages"][rank::world]  # (len(shard),)
    weight = shard_weight(shard, samples, config.aggregation)
    step = AllReduceStep(optimizer, params, weight, config.max_grad_norm)
    with _autocast(device):
        history = train_on_batch(model, step, shard, advantages, config.model_copy(update={"max_grad_norm": math.inf}),
                                 args["temperature"])

    token_share = sum(map(scored_tokens, shard)) / sum(map(scored_tokens, samples))
    combined = []
    for m, grad_norm in zip(history, step.grad_norms):
        # Whole-batch metrics: the loss adds up like the gradient; token-weighted means by token share.
        sums = torch.tensor([m["loss"] * weight, m["tokens"], *(m.get(k, 0.0) * token_share for k in TOKEN_STATS)],
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
        combined.append(out)
    if rank == 0:
        state = {n: p.detach().cpu() for n, p in trainable.items()}
        ray.get(args["mailbox"].put.remote(state, _cpu(optimizer.state_dict()), combined))


def _cpu(state: Any) -> Any:
    """An optimizer state dict with every tensor on the CPU: what travels between machines."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.cpu()
    if isinstance(state, dict):
        return {k: _cpu(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_cpu(v) for v in state]
    return state


class _Mailbox:
    """A Ray actor the rank-0 worker hands its result to (plain objects, through the object store)."""

    def __init__(self) -> None:
        self.value: Any = None

    def put(self, *value: Any) -> None:
        self.value = value

    def get(self) -> Any:
        return self.value


def _train_distributed(model: Any, optimizer: Any, samples: list[Sample], advantages: torch.Tensor,
                       config: GRPOConfig, workers: int, *, temperature: float, ctx: StageContext,
                       base_model: str) -> list[dict[str, float]]:
    import ray
    import torch
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from stages.cluster import connect, reserve

    connect(ctx.ray, num_cpus=workers)
    reserve(workers, f"grpo.workers: {workers}", ctx.ray.placement_timeout_s)  # Ray Train starts them together
    use_gpu = torch.cuda.is_available()
    trainable = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
    mailbox = ray.remote(num_cpus=0)(_Mailbox).remote()
    # A parent adapter loaded from its files carries `inference_mode=True` in its config: the workers would build an
    # untrainable adapter from it (issue 43: "the worker's adapter differs from the driver's" after an SFT step).
    peft_config = copy.deepcopy(model.peft_config[model.active_adapter])
    peft_config.inference_mode = False
    args = {"config": config, "temperature": temperature, "base_model": base_model, "peft_config": peft_config,
            "weights": trainable, "optimizer": _cpu(optimizer.state_dict()), "samples": samples,
            "advantages": advantages.float().cpu(), "mailbox": mailbox}
    start = time.perf_counter()
    trainer = TorchTrainer(
        _worker_loop, train_loop_config=args,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu),
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        # Ray Train keeps its run records here; nothing is checkpointed through it (see the module docstring).
        run_config=RunConfig(name=f"grpo-{int(time.time() * 1000)}", storage_path=str(ctx.ws.root / "ray_train")),
    )
    trainer.fit()
    state, optimizer_state, history = ray.get(mailbox.get.remote())
    ray.kill(mailbox)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in state:
                p.copy_(state[name].to(p.device))
    optimizer.load_state_dict(optimizer_state)
    for m in history:  # wall time of the whole update, including starting the workers
        m["update_seconds"] = time.perf_counter() - start
    return history
