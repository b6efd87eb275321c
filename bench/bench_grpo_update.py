"""GRPO update alone on SmolLM2-135M-Instruct: trained tokens/s and peak RSS.

A synthetic batch (4 prompts x G=8, ~40 prompt tokens, 32 completion tokens, random
advantages, behaviour log-probs from the model itself) and a fresh LoRA (r=16 on q/k/v/o);
no generation, no storage. Run: `.venv/bin/python bench/bench_grpo_update.py [--steps 3] [--no-share-prompts]`.

`--alternate`: activation checkpointing on and off, each with the entropy differentiated (entropy_coef 1e-30: nothing
added to the loss) and only logged (entropy_coef 0, the default), taking turns in one process, `--steps` rounds after a
warm-up; the median update of each (what issue 57 changed: the parity config trains without checkpointing, and the
logged entropy has no backward). The four give the same update bit for bit (tests/stages/test_grpo.py).

`--autocast`: the parity config's update (checkpointing off, entropy logged) in fp32 and under torch's bf16 autocast on
the CPU (weights stay fp32, matmuls run in bf16, on AMX where the CPU has it), in turns from the same start; the median
of each and how far apart the two updates' LoRA weights land. Measured, not adopted (docs/BENCHMARKS.md: 1.01x).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import loopback  # bench/loopback.py: run under .ci/loopback


def main(steps: int, micro_batch_size: int, threads: int | None, checkpointing: bool, share: bool,
         alternate: bool = False, autocast: bool = False) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from stages.policy.logprobs import token_logprobs
    from stages.policy.lora import add_lora
    from stages.policy.model import resolve_model
    from stages.update.config import GRPOConfig
    from stages.update.data import Sample
    from stages.update.train import train_on_batch

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    prompts, group, prompt_len, new_tokens = 4, 8, 40, 32
    model = AutoModelForCausalLM.from_pretrained(resolve_model("SmolLM2-135M-Instruct"), dtype=torch.float32)
    config = GRPOConfig(micro_batch_size=micro_batch_size, activation_checkpointing=checkpointing, share_prompts=share)
    model = add_lora(model, config.lora)
    vocab = model.config.vocab_size

    # Each group shares its prompt; lengths vary a little, as real completions do.
    ids, masks = [], []
    for p in range(prompts):
        prompt = torch.randint(0, vocab, (prompt_len + p,)).tolist()
        for _ in range(group):
            ids.append(prompt + torch.randint(0, vocab, (new_tokens,)).tolist())
            masks.append([0] * len(prompt) + [1] * new_tokens)
    with torch.no_grad():  # behaviour log-probs from the model itself: the first pass is on-policy
        T = max(map(len, ids))
        x = torch.tensor([s + [0] * (T - len(s)) for s in ids])
        attn = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in ids])
        m = torch.tensor([s + [0] * (T - len(s)) for s in masks])
        blp = token_logprobs(model, x, attn, m)  # (B, T)
    samples = [Sample(s, mk, blp[i, : len(s)].tolist()) for i, (s, mk) in enumerate(zip(ids, masks))]
    advantages = torch.randn(len(samples))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr)

    if alternate:
        return alternated(model, optimizer, samples, advantages, config, steps)
    if autocast:
        return autocast_turns(model, optimizer, samples, advantages, config, steps)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {len(samples)} sequences "
          f"(prompt {prompt_len}-{prompt_len + prompts - 1} + {new_tokens} completion tokens), "
          f"micro_batch_size {micro_batch_size}, activation checkpointing {checkpointing}, shared prompts {share}, LoRA r={config.lora.r} on {','.join(config.lora.target_modules)}")
    for step in range(steps):
        start, cpu = time.perf_counter(), time.process_time()
        (metrics,) = train_on_batch(model, optimizer, samples, advantages, config, temperature=1.0)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        # CPU seconds too: on a shared machine wall time mostly measures the neighbours.
        print(f"step {step}: {seconds:6.2f} s wall, {cpu:6.2f} s CPU  {metrics['tokens'] / seconds:6.1f} trained tokens/s  "
              f"ratio_mean {metrics['ratio_mean']:.5f}  grad_norm {metrics['grad_norm']:.3f}  loss {metrics['loss']:+.4f}")
    # ru_maxrss is KiB on Linux, bytes on macOS
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)
    print(f"peak RSS {peak:.0f} MiB")


def alternated(model, optimizer, samples, advantages, config, rounds: int) -> None:
    """The four variants of the module docstring's `--alternate`, in turns; each one's median seconds per update."""
    import statistics

    from stages.update.train import train_on_batch

    variants = {f"checkpointing {'on' if ckpt else 'off'}, entropy {'differentiated' if coef else 'logged'}":
                config.model_copy(update={"activation_checkpointing": ckpt, "entropy_coef": coef})
                for ckpt in (True, False) for coef in (1e-30, 0.0)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for rnd in range(rounds + 1):  # round 0 warms up
        for name, variant in variants.items():
            start = time.perf_counter()
            train_on_batch(model, optimizer, samples, advantages, variant, temperature=1.0)
            if rnd:
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times[next(iter(times))])
    for name, t in times.items():
        med = statistics.median(t)
        print(f"{name}: median {med:.2f} s ({', '.join(f'{x:.2f}' for x in t)}), {base / med:.2f}x the first")


def autocast_turns(model, optimizer, samples, advantages, config, rounds: int) -> None:
    """fp32 and bf16 autocast (`--autocast`), in turns from the same weights and optimizer state each round; each
    one's median seconds per update, and the largest difference between the two updates' LoRA weights."""
    import copy
    import statistics
    from contextlib import nullcontext

    import torch

    from stages.update.train import train_on_batch

    config = config.model_copy(update={"activation_checkpointing": False, "entropy_coef": 0.0})
    start_state = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    times: dict[str, list[float]] = {"fp32": [], "bf16 autocast": []}
    after: dict[str, dict[str, torch.Tensor]] = {}
    for rnd in range(rounds + 1):  # round 0 warms up
        for name, bf16 in (("fp32", False), ("bf16 autocast", True)):
            model.load_state_dict(start_state[0])
            optimizer.load_state_dict(start_state[1])
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext():
                train_on_batch(model, optimizer, samples, advantages, config, temperature=1.0)
            if rnd:
                times[name].append(time.perf_counter() - start)
            after[name] = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    base = statistics.median(times["fp32"])
    for name, t in times.items():
        med = statistics.median(t)
        print(f"{name}: median {med:.2f} s ({', '.join(f'{x:.2f}' for x in t)}), {base / med:.2f}x fp32")
    gap = max((after["fp32"][k] - after["bf16 autocast"][k]).abs().max().item() for k in after["fp32"])
    moved = max((after["fp32"][k] - start_state[0][k]).abs().max().item() for k in after["fp32"])
    print(f"LoRA weights after one update: max |fp32 - bf16| {gap:.2e} (the fp32 update moved them by up to {moved:.2e})")


if __name__ == "__main__":
    loopback.enter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--no-activation-checkpointing", action="store_true")
    parser.add_argument("--no-share-prompts", action="store_true", help="run every sample's prompt (grpo.share_prompts off)")
    parser.add_argument("--alternate", action="store_true", help="checkpointing on/off x entropy differentiated/logged, in turns")
    parser.add_argument("--autocast", action="store_true", help="fp32 and bf16 autocast, in turns")
    args = parser.parse_args()
    main(args.steps, args.micro_batch_size, args.threads, not args.no_activation_checkpointing, not args.no_share_prompts,
         args.alternate, args.autocast)
