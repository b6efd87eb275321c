"""Where a GRPO update runs: in this process, or data-parallel over a resident Ray worker group.

    result = workers.train(model, optimizer, samples, advantages, config, temperature=1.0, ctx=ctx, base_model=base)
    result.history   # one metrics dict per epoch

`grpo.workers: 1` runs `stages.update.train.train_on_batch` here (on CUDA under bf16 autocast with the fp32
weights, and with a resident vLLM engine asleep meanwhile). `grpo.workers: N` runs the same function in the N
ranks of an update worker group (stages/update/group.py: Ray actors joined by torch.distributed, gloo on CPU,
NCCL on GPUs), each on a shard of the samples, on the run's `ray:` cluster or a local Ray. The group is started
at a run's first update and kept by its `PolicySession` (`ctx.session`) for the next ones; without a session
(`rlops stage grpo`) it lives for the one update. The driver's model and optimizer state travel to the workers
through Ray's object store (no driver-local path is read there), and the trained adapter and optimizer state
come back the same way: the driver writes the checkpoint once, as for one worker, so the catalog and lineage do
not depend on the number of workers. A step with fewer samples than workers (every rank needs one) runs here.

A step whose group fails (a worker killed, its node stopped) is retried once by a fresh group, from the same
driver state (a failed step changes nothing here); a second failure raises, naming the workers.

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
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stages.update.config import GRPOConfig
from stages.update.data import Sample
from stages.update.train import train_on_batch

if TYPE_CHECKING:
    import torch

    from stages.common import StageContext

TOKEN_STATS = ("clip_frac_low", "clip_frac_high", "ratio_mean", "kl", "is_weight_mean", "is_masked_frac")  # token-weighted means in train_on_batch


@dataclass
class UpdateResult:
    """What an update did: one metrics dict per epoch (as `train_on_batch`), and where it ran."""

    history: list[dict[str, float]]
    # (object ref, sha256) of the new LoRA weights in Ray's object store, as the worker group returned them;
    # None for an update in this process (stages.policy.session.PolicySession.updated ships them from there)
    stored: tuple[Any, str] | None = None
    placements: list[str] = field(default_factory=list)  # the update workers' `<node id>:<pid>:<parent pid>`


def train(model: Any, optimizer: Any, samples: list[Sample], advantages: torch.Tensor, config: GRPOConfig, *,
          temperature: float, ctx: StageContext, base_model: str) -> UpdateResult:
    """`train_on_batch` (at the samples' sampling `temperature`) with `config.workers` workers; updates
    `model` and `optimizer` in place. Each epoch's metrics carry `update_seconds`, the wall time of the
    whole update (a worker group's start included, when it started for this one)."""
    from stages.policy.vllm import engines_asleep

    start = time.perf_counter()
    # a resident vLLM engine gives its GPU memory to training meanwhile, unless it generates ahead (async run)
    with engines_asleep() if config.sleep_generation else nullcontext():
        if config.workers > 1 and len(samples) >= config.workers:  # every rank needs at least one sample
            result = _train_distributed(model, optimizer, samples, advantages, config, temperature=temperature,
                                        ctx=ctx, base_model=base_model)
        else:
            with _autocast(next(model.parameters()).device):
                result = UpdateResult(train_on_batch(model, optimizer, samples, advantages, config, temperature))
    for m in result.history:
        m["update_seconds"] = time.perf_counter() - start
    return result


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
    with _autocast(device):
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


def _train_distributed(model: Any, optimizer: Any, samples: list[Sample], advantages: torch.Tensor,
                       config: GRPOConfig, *, temperature: float, ctx: StageContext, base_model: str) -> UpdateResult:
    """The update on the worker group (the session's, or one for this update): the driver's weights and
    optimizer state out, rank 0's back into `model` and `optimizer`; a failed group is replaced once."""
    import ray
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    from stages.policy.session import adapter_digest
    from stages.update.group import GroupFailure

    # A parent adapter loaded from its files carries `inference_mode=True` in its config: the workers would build an
    # untrainable adapter from it (issue 43: "the worker's adapter differs from the driver's" after an SFT step).
    peft_config = copy.deepcopy(model.peft_config[model.active_adapter])
    peft_config.inference_mode = False
    common = {"config": config, "temperature": temperature, "peft_config": peft_config,
              "state": {k: v.detach().cpu() for k, v in get_peft_model_state_dict(model).items()},
              "optimizer": cpu_state(optimizer.state_dict())}
    parts = shards(samples, advantages, config.workers, config.aggregation)
    failure: GroupFailure | None = None
    for attempt in (1, 2):
        group = None
        try:
            group, started = _group(ctx, base_model, config.workers)  # a group that fails to start fails like a step
            state_ref, out = group.step(common, parts)
            state = ray.get(state_ref)  # before a group of this update alone is stopped
            break
        except GroupFailure as e:
            _forget(ctx, group)
            if attempt == 2:
                raise RuntimeError(f"{e}; the step was retried once by a fresh worker group, which failed too "
                                   f"(first failure: {failure})") from None
            failure = e
            print(f"grpo.workers: {e}; retrying the step once with a fresh worker group", file=sys.stderr, flush=True)
        finally:
            if ctx.session is None and group is not None:
                group.stop()
    if adapter_digest(state) != out["digest"]:
        raise RuntimeError("the update workers' LoRA weights arrived with another sha256 than rank 0 sent")
    if set_peft_model_state_dict(model, state).unexpected_keys:
        raise RuntimeError("the update workers returned LoRA weights the driver's adapter does not have")
    optimizer.load_state_dict(out["optimizer"])
    for m in out["history"]:
        m.update(update_group_start_seconds=group.start_seconds if started else 0.0, update_retries=float(attempt - 1))
    return UpdateResult(out["history"], (state_ref, out["digest"]), group.placements)


def _group(ctx: StageContext, base_model: str, workers: int) -> tuple[Any, bool]:
    """(the update worker group for `base_model`, whether it started now): the session's (started on first use,
    stopped when the session closes), or a new one the caller stops."""
    from stages.update.group import UpdateGroup

    if ctx.session is None:
        return UpdateGroup.start(ctx.ray, base_model, workers), True
    started = []

    def start() -> UpdateGroup:
        group = UpdateGroup.start(ctx.ray, base_model, workers)
        ctx.session.on_close(group.stop)
        started.append(group)
        return group

    return ctx.session.keep(_group_key(base_model, workers), start), bool(started)


def _group_key(base_model: str, workers: int) -> tuple:
    return ("update-group", base_model, workers)


def _forget(ctx: StageContext, group: Any) -> None:
    """Drop a failed group (None: it failed while starting) from the session: the next update starts a fresh one."""
    if ctx.session is not None and group is not None:
        for key in [k for k, v in ctx.session.kept.items() if v is group]:
            del ctx.session.kept[key]
