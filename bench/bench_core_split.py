"""Can asynchronous steps gain on a 2-core CPU by splitting the cores (1 + 1) between generation and the update?

Two threads of one process, as `max_staleness: K > 0` runs them (flows/async_steps.py): one decodes (the
parity workload's shape: 32 rows, 42-token prompts, 32 new tokens, KV cache, greedy), the other trains (4
forward + backward + optimizer steps on 8 x 74 tokens, the whole model). Each is timed alone on 2 threads
and on 1, then both at once with 2 threads each (what the pipeline does today) and with 1 each
(`torch.set_num_threads` in each thread: the OpenMP thread count is per calling thread, so the split
holds). The best a split could do is max(gen on 1 thread, train on 1 thread); the sequential loop costs
gen + train on 2 threads.

    .venv/bin/python bench/bench_core_split.py [--reps 2]
"""

from __future__ import annotations

import argparse
import threading
import time

import loopback  # bench/loopback.py: run under .ci/loopback
from bench_host import decode  # the prefill and greedy decoding, timed the same way as there


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from stages.policy.model import resolve_model

    path = resolve_model("SmolLM2-135M-Instruct")
    gen_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    train_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.SGD(train_model.parameters(), lr=0.0)  # lr 0: the same work every repetition
    torch.manual_seed(0)
    prompts, batch = torch.randint(100, 40000, (32, 42)), torch.randint(100, 40000, (8, 74))

    def generate(threads: int) -> float:
        torch.set_num_threads(threads)
        start = time.perf_counter()
        decode(gen_model, prompts)
        return time.perf_counter() - start

    def train(threads: int) -> float:
        torch.set_num_threads(threads)
        start = time.perf_counter()
        for _ in range(4):
            train_model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return time.perf_counter() - start

    def together(threads: int) -> tuple[float, float, float]:
        gen: list[float] = []
        thread = threading.Thread(target=lambda: gen.append(generate(threads)))
        start = time.perf_counter()
        thread.start()
        trained = train(threads)
        thread.join()
        return time.perf_counter() - start, gen[0], trained

    generate(2), train(2)  # warm-up
    for rep in range(args.reps):
        g2, t2, g1, t1 = generate(2), train(2), generate(1), train(1)
        w22, g22, t22 = together(2)
        w11, g11, t11 = together(1)
        print(f"rep {rep + 1}: sequential, 2 threads: gen {g2:.1f} + train {t2:.1f} = {g2 + t2:.1f} s | alone on 1 thread: "
              f"gen {g1:.1f}, train {t1:.1f} (best split {max(g1, t1):.1f}) | together 2+2: {w22:.1f} s (gen {g22:.1f}, "
              f"train {t22:.1f}) | together 1+1: {w11:.1f} s (gen {g11:.1f}, train {t11:.1f})", flush=True)
        torch.set_num_threads(2)


if __name__ == "__main__":
    loopback.enter()
    main()
