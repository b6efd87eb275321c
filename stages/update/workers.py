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
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stages.update.config import GRPOConfig
from stages.update.data import Sample
from stages.update.shards import autocast, cpu_state, shards
from stages.update.train import train_on_batch

if TYPE_CHECKING:
    import torch

    from stages.common import StageContext


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
            with autocast(next(model.parameters()).device):
                result = UpdateResult(train_on_batch(model, optimizer, samples, advantages, config, temperature))
    for m in result.history:
        m["update_seconds"] = time.perf_counter() - start
    return result


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
    begin = time.perf_counter()
    common = {"config": config, "temperature": temperature, "peft_config": peft_config,
              "state": {k: v.detach().cpu() for k, v in get_peft_model_state_dict(model).items()},
              "optimizer": cpu_state(optimizer.state_dict())}
    parts = shards(samples, advantages, config.workers, config.aggregation)
    packed_at = time.perf_counter()
    failure: GroupFailure | None = None
    for attempt in (1, 2):
        group = None
        try:
            group, started = _group(ctx, base_model, config.workers, config.dtype)  # a group that fails to start fails like a step
            stepped_at = time.perf_counter()
            state_ref, out = group.step(common, parts)
            fetched_at = time.perf_counter()
            state = ray.get(state_ref)  # before a group of this update alone is stopped
            fetched = time.perf_counter() - fetched_at
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
    # Where the step's time went outside the ranks' training (bench/bench_ddp.py): the driver's packing, Ray's put,
    # the CPUs' placement group, rank 0's taking and returning of weights, the fetch, and applying them here.
    timing = {"pack_s": packed_at - begin, "group_get_s": stepped_at - packed_at, **out.get("timing", {}),
              "fetch_s": fetched, "apply_s": time.perf_counter() - fetched_at - fetched}
    for m in out["history"]:
        m.update(update_group_start_seconds=group.start_seconds if started else 0.0, update_retries=float(attempt - 1),
                 **{f"update_{k}": v for k, v in timing.items()})
    return UpdateResult(out["history"], (state_ref, out["digest"]), group.placements)


def _group(ctx: StageContext, base_model: str, workers: int, dtype: str | None = None) -> tuple[Any, bool]:
    """(the update worker group for `base_model` in `dtype`, whether it started now): the session's (started on first
    use, stopped when the session closes), or a new one the caller stops."""
    from stages.update.group import UpdateGroup

    if ctx.session is None:
        return UpdateGroup.start(ctx.ray, base_model, workers, dtype), True
    started = []

    def start() -> UpdateGroup:
        group = UpdateGroup.start(ctx.ray, base_model, workers, dtype)
        ctx.session.on_close(group.stop)
        started.append(group)
        return group

    return ctx.session.keep(_group_key(base_model, workers, dtype), start), bool(started)


def _group_key(base_model: str, workers: int, dtype: str | None = None) -> tuple:
    return ("update-group", base_model, workers, dtype or "float32")


def _forget(ctx: StageContext, group: Any) -> None:
    """Drop a failed group (None: it failed while starting) from the session: the next update starts a fresh one."""
    if ctx.session is not None and group is not None:
        for key in [k for k, v in ctx.session.kept.items() if v is group]:
            del ctx.session.kept[key]
