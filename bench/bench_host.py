"""The host's speed at the parity workload's shape, with no rlops code in the way: plain forward passes.

Loads the default model (SmolLM2-135M-Instruct, fp32) with `AutoModelForCausalLM`, prefills 32 rows of
42 random tokens and decodes 32 tokens greedily with the KV cache (the arithmetic rollout's shape), and
times a 2048x2048 fp32 matmul. Use it to tell a slow day from a slow change: run it under two library
versions (put one first on PYTHONPATH) or on two days, and compare with docs/BENCHMARKS.md.

    .venv/bin/python bench/bench_host.py [--reps 2] [--threads 2] [--model PATH]
"""

from __future__ import annotations

import argparse
import time

import loopback  # bench/loopback.py: run under .ci/loopback


def decode(model, ids, steps: int = 32) -> float:
    """Seconds to decode `steps` greedy tokens after the prefill of `ids` (32 x 42: the parity rollout's shape)."""
    import torch

    from stages.policy.kv_cache import cache_kwarg

    name = cache_kwarg()  # `cache` in transformers 5 (`past_key_values` is deprecated there)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        start = time.perf_counter()
        for _ in range(steps):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            out = model(input_ids=token, use_cache=True, **{name: getattr(out, name)})
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", help="a model folder (default: the cached default model)")
    args = parser.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    path = args.model
    if path is None:
        from stages.policy.model import resolve_model

        path = resolve_model("SmolLM2-135M-Instruct")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} threads")

    a = torch.randn(2048, 2048)
    a @ a
    start = time.perf_counter()
    for _ in range(5):
        a @ a
    print(f"matmul 2048^2 fp32: {5 * 2 * 2048**3 / (time.perf_counter() - start) / 1e9:.0f} GFLOP/s")

    ids = torch.randint(100, 40000, (32, 42))
    for rep in range(args.reps):
        start = time.perf_counter()
        decoding = decode(model, ids)
        print(f"rep {rep + 1}: prefill 32x42 {time.perf_counter() - start - decoding:.2f} s, "
              f"32 decode steps {decoding:.2f} s")


if __name__ == "__main__":
    loopback.enter()
    main()
