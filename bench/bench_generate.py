"""Rollout-stage overhead: `run_episodes` over HFBackend vs a bare batched `model.generate`.

SmolLM2-135M-Instruct on CPU, 4 arithmetic prompts x G=8 samples = 32 rows, 32 new tokens,
temperature 1.0, single turn, no tools. Both paths sample from the same seed with the same
settings; before issue 11 they drew the very same tokens and the ratio was pure overhead: chat
templating, the log-prob recorder, cutting rows, building episodes. Since issue 11 HFBackend
samples with its own inverse-CDF sampler and prefills a group's shared prompt once, so it draws
other (equally distributed) tokens than generate's multinomial, and the ratio also counts those
two speed-ups; `identical samples` then reads False. On a shared machine the
throughputs swing with other load; the overhead share measured inside each run is the steadier
number (see `rollout` below).

    .venv/bin/python bench/bench_generate.py [--reps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import loopback  # bench/loopback.py: run under .ci/loopback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    import torch

    from stages.policy import hf as gen
    from stages.policy.agent_loop import EpisodeSpec, run_episodes, turn_seed
    from stages.policy.chat import ChatFormat
    from stages.policy.hf import HFBackend
    from stages.policy.load import load_policy
    from stages.policy.sampling import SamplingConfig
    from storage.schema import Message
    from tasks.base import load_task

    torch.set_num_threads(args.threads)
    model, tokenizer = load_policy("SmolLM2-135M-Instruct", device="cpu")
    task = load_task("arithmetic")
    specs = [EpisodeSpec(p, seed=g) for p in task.prompts("train")[:4] for g in range(args.group)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.new_tokens)
    backend = HFBackend(model, tokenizer)

    # The bare baseline gets the same prompts, left-padded, and the seed run_episodes will use.
    chat = ChatFormat(tokenizer)
    prompts = [
        chat.encode(chat.render([Message(m["role"], m["content"]) for m in task.messages(s.prompt)], True))
        for s in specs
    ]
    seed = turn_seed(sampling.seed, [s.seed for s in specs], 0)
    width = max(map(len, prompts))
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])  # (B, P)
    attention_mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    eos = tokenizer.eos_token_id

    def bare() -> tuple[int, list[list[int]]]:
        with torch.random.fork_rng(devices=[]), torch.inference_mode():
            torch.manual_seed(seed)
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=args.new_tokens,
                pad_token_id=eos,
                eos_token_id=eos,
            )  # (B, P + n)
        rows = [row[: row.index(eos) + 1] if eos in row else row for row in out[:, width:].tolist()]
        return sum(map(len, rows)), rows

    # On a shared machine both timings swing with other processes' load, so the overhead is also
    # measured inside each run_episodes call: its time outside model.generate plus the log-prob
    # recorder's time inside it (the only work bare generate does not do). Both parts of one run
    # see the same load, so this share is the stable number.
    spent = {"generate": 0.0, "recorder": 0.0}

    def timed(fn: Callable, key: str) -> Callable:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t0

        return wrapper

    model.generate = timed(model.generate, "generate")
    gen._LogprobRecorder._collect = timed(gen._LogprobRecorder._collect, "recorder")
    overhead: list[float] = []

    def rollout() -> tuple[int, list[list[int]]]:
        spent.update(generate=0.0, recorder=0.0)
        t0 = time.perf_counter()
        episodes = run_episodes(backend, tokenizer, task, specs, sampling, max_total_tokens=4096)
        total = time.perf_counter() - t0
        overhead.append((total - spent["generate"] + spent["recorder"]) / total)
        rows = [[t for t, m in zip(e.token_ids, e.loss_mask) if m] for e in episodes]
        return sum(map(len, rows)), rows

    bare(), rollout()  # warm-up: first-call allocations and lazy imports
    names = ("bare model.generate", "run_episodes (HFBackend)")
    # Wall time is what a user waits for; CPU time (all threads of this process) is the work done,
    # which other processes on a shared machine disturb far less.
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    same = True
    for _ in range(args.reps):  # interleaved, so drift in machine load hits both alike
        results = []
        for name, fn in zip(names, (bare, rollout)):
            t0, c0 = time.perf_counter(), time.process_time()
            tokens, rows = fn()
            wall[name].append(tokens / (time.perf_counter() - t0))
            cpu[name].append(tokens / (time.process_time() - c0))
            results.append(rows)
        same &= results[0] == results[1]

    print(
        f"SmolLM2-135M-Instruct, CPU, {torch.get_num_threads()} threads, {len(specs)} rows "
        f"(4 prompts x G={args.group}), {args.new_tokens} new tokens, T=1.0, {args.reps} reps (median)"
    )
    for clock, speeds in (("wall", wall), ("cpu", cpu)):
        for name in names:
            runs = ", ".join(f"{v:.1f}" for v in speeds[name])
            print(f"  {name:26s} {statistics.median(speeds[name]):7.1f} tok/s ({clock} time)   runs: {runs}")
        ratio = statistics.median(speeds[names[1]]) / statistics.median(speeds[names[0]])
        print(f"  ratio run_episodes / bare ({clock} time): {ratio:.3f}")
    shares = ", ".join(f"{100 * v:.2f}%" for v in overhead[1:])
    print(f"  overhead share inside run_episodes: {100 * statistics.median(overhead[1:]):.2f}%   runs: {shares}")
    print(f"  => throughput ratio from the overhead share: {1 - statistics.median(overhead[1:]):.3f}")
    print(f"  identical samples: {same}")
    print(f"  peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    loopback.enter()
    main()
