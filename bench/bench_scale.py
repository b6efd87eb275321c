"""Scale-out overheads on one machine: rollout throughput with 1 and 2 Ray workers on a real two-node
local cluster, and the GRPO update with 1 (in-process) and 2 DDP workers (an update worker group started for it).

    PYTHONPATH=. .venv/bin/python bench/bench_scale.py [--part rollout|grpo|both] [--model SmolLM2-135M-Instruct]

rollout: starts `ray start --head` (no CPUs) + `ray start --address=...` (2 CPUs) on 127.0.0.1
(tests/ray_cluster.py), then generates the same shards (8 arithmetic prompts x G=4, 16 new tokens,
one prompt per shard) with 1 and with 2 `RolloutWorker` actors on the worker node, as the rollout
stage does (torch threads: 2 for one actor, 1 each for two; and a control: one actor, one thread);
reports sampled tokens/s (actor start-up, i.e. loading the model, timed apart).
grpo: one update on a synthetic batch (bench_grpo_update.py's: 4 prompts x G=8, 32 completion tokens)
in this process (all cores' threads, and a 1-thread control) and with `grpo.workers: 2` (stages/update/group.py, gloo,
one thread per worker); reports wall time, the
time of the optimizer step itself, and the largest adapter-weight difference between the two.

On 2 shared cores this shows overhead, not speed-up: two workers split the same two cores.
Ray starts its workers at niceness 15; here they run at 0 (`RAY_worker_niceness=0`), like this
process, so that other jobs on a shared machine slow both sides alike.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from pathlib import Path

import loopback  # bench/loopback.py: run under .ci/loopback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def bench_rollout(model: str) -> None:
    from tests.ray_cluster import LocalRayCluster

    with LocalRayCluster(worker_cpus=2, env={"RAY_worker_niceness": "0"}) as cluster:
        os.environ.update({k: cluster.env[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")})  # before Ray is imported
        import ray

        from stages.cluster import RayConfig, connect
        from stages.rollout import RolloutConfig, RolloutWorker, TaskSpec, select_prompts
        from tasks.base import load_task

        connect(RayConfig(address=cluster.address), num_cpus=2)
        task = TaskSpec(name="arithmetic")
        config = RolloutConfig(prompts_per_step=8, group_size=4, max_new_tokens=16, groups_per_shard=1)
        prompts = select_prompts(load_task(task.name, task.params).prompts("train"), 8, 0)
        shards = [[(i, p)] for i, p in enumerate(prompts)]
        Actor = ray.remote(num_cpus=1)(RolloutWorker)
        results = {}
        # (actors, torch threads per actor): one actor with both cores' threads, as the rollout stage
        # starts it; one actor with one thread (a control: threads that wait on each other suffer on a
        # loaded machine); two actors with one thread each.
        for workers, threads in ((1, 2), (1, 1), (2, 1)):
            start = time.perf_counter()
            actors = [Actor.remote(config, model, task, threads) for _ in range(workers)]
            ray.get([a.prepare.remote(config, "base", None) for a in actors])
            nodes = ray.get([a.where.remote() for a in actors])
            assert all(n.split(":")[0] == cluster.worker_node_id for n in nodes)
            startup = time.perf_counter() - start
            start = time.perf_counter()
            tables = ray.get([actors[i % workers].run_shard.remote("bench", "train", s, 0) for i, s in enumerate(shards)])
            seconds = time.perf_counter() - start
            tokens = sum(sum(m) for t in tables for m in t["loss_mask"].to_pylist())
            results[workers, threads] = tokens / seconds
            print(f"rollout, {workers} Ray worker(s) x {threads} thread(s) on the worker node: {tokens} sampled tokens in {seconds:.1f} s "
                  f"= {tokens / seconds:.1f} tok/s (actor start-up {startup:.1f} s)", flush=True)
            for a in actors:
                ray.kill(a)
        print(f"rollout throughput, 2 workers / 1 worker: {results[2, 1] / results[1, 2]:.2f}x "
              f"(/ 1 worker with 1 thread: {results[2, 1] / results[1, 1]:.2f}x)")
        ray.shutdown()


def bench_grpo(model_name: str) -> None:
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from stages.common import StageContext
    from stages.policy.logprobs import token_logprobs
    from stages.policy.lora import add_lora
    from stages.policy.model import resolve_model
    from stages.update.config import GRPOConfig
    from stages.update.data import Sample
    from stages.update.train import train_on_batch
    from stages.update.workers import train
    from storage.workspace import Workspace

    torch.manual_seed(0)
    prompts, group, prompt_len, new_tokens = 4, 8, 40, 32
    config = GRPOConfig()
    model = add_lora(AutoModelForCausalLM.from_pretrained(resolve_model(model_name), dtype=torch.float32), config.lora)
    vocab = model.config.vocab_size
    ids, masks = [], []
    for p in range(prompts):
        prompt = torch.randint(0, vocab, (prompt_len + p,)).tolist()
        for _ in range(group):
            ids.append(prompt + torch.randint(0, vocab, (new_tokens,)).tolist())
            masks.append([0] * len(prompt) + [1] * new_tokens)
    with torch.no_grad():
        T = max(map(len, ids))
        x = torch.tensor([s + [0] * (T - len(s)) for s in ids])
        attn = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in ids])
        m = torch.tensor([s + [0] * (T - len(s)) for s in masks])
        blp = token_logprobs(model, x, attn, m)  # (B, T)
    samples = [Sample(s, mk, blp[i, : len(s)].tolist()) for i, (s, mk) in enumerate(zip(ids, masks))]
    advantages = torch.randn(len(samples))
    twin, control = copy.deepcopy(model), copy.deepcopy(model)

    torch.set_num_threads(1)  # a control: threads that wait on each other suffer on a loaded machine
    opt1 = torch.optim.AdamW([p for p in control.parameters() if p.requires_grad], lr=config.lr)
    (single,) = train_on_batch(control, opt1, samples, advantages, config, temperature=1.0)
    print(f"grpo update, 1 worker (in process), 1 thread: {single['tokens'] / single['tokens_per_s']:.1f} s, "
          f"{single['tokens_per_s']:.1f} trained tok/s", flush=True)

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr)
    torch.set_num_threads(os.cpu_count() or 1)  # one worker gets every core; two DDP workers get one each
    start = time.perf_counter()
    (one,) = train_on_batch(model, opt, samples, advantages, config, temperature=1.0)
    wall_one = time.perf_counter() - start
    print(f"grpo update, 1 worker (in process), {torch.get_num_threads()} threads: {wall_one:.1f} s wall, "
          f"{one['tokens']:.0f} tokens, {one['tokens_per_s']:.1f} trained tok/s", flush=True)

    opt2 = torch.optim.AdamW([p for p in twin.parameters() if p.requires_grad], lr=config.lr)
    ctx = StageContext(Workspace.open(Path(tempfile.mkdtemp()) / "ws"))
    start = time.perf_counter()
    (two,) = train(twin, opt2, samples, advantages, config.model_copy(update={"workers": 2}), temperature=1.0, ctx=ctx,
                   base_model=model_name).history
    wall_two = time.perf_counter() - start
    ray.shutdown()
    worst = max((p.detach() - q.detach()).abs().max().item()
                for (_, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()) if p.requires_grad)
    step_two = two["tokens"] / two["tokens_per_s"]
    print(f"grpo update, 2 DDP workers (an update worker group, gloo): {wall_two:.1f} s wall (incl. Ray + worker start-up and "
          f"model loads), {step_two:.1f} s in the step itself, {two['tokens_per_s']:.1f} trained tok/s; "
          f"max |Δ adapter| vs 1 worker {worst:.2e}, grad_norm {one['grad_norm']:.5f} vs {two['grad_norm']:.5f}")
    print(f"grpo step time, 2 workers / 1 worker: {step_two / (one['tokens'] / one['tokens_per_s']):.2f}x "
          f"(/ 1 worker with 1 thread: {step_two / (single['tokens'] / single['tokens_per_s']):.2f}x); "
          f"wall: {wall_two / wall_one:.2f}x")


if __name__ == "__main__":
    loopback.enter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["rollout", "grpo", "both"], default="both")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    args = parser.parse_args()
    os.environ["RAY_worker_niceness"] = "0"  # for the local Ray of the GRPO part (see the docstring)
    print(f"{os.cpu_count()} CPUs")
    if args.part in ("rollout", "both"):
        bench_rollout(args.model)
    if args.part in ("grpo", "both"):
        bench_grpo(args.model)
