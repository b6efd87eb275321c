"""Prompt sharing in the HF backend: one prefill per distinct prompt (the G samples of a group) vs one per row,
and (`--eval`) the common prefix of distinct prompts (the system prompt an evaluation's prompts share) run once.

SmolLM2-135M-Instruct on CPU, 4 prompts x G=8 = 32 rows, a first turn sampled at T=1 from the same
seed, with `HFBackend(share_prompts=True)` and `False`, alternating, in one process. Tasks:
arithmetic (short prompts, 32 new tokens: the parity workload) and doc_search (system + tool schemas,
~400-token prompts, 96 new tokens). Also reported: how many rows' tokens differ between the two
(the same tokens in exact arithmetic; float rounding differs between a (U, P) and a (B, P) prefill,
and a sampled row can diverge where its uniform draw falls within rounding of a CDF boundary), and
the largest log-prob difference up to each row's first different token.

    .venv/bin/python bench/bench_prefill.py [--reps 3] [--threads 2]
    .venv/bin/python bench/bench_prefill.py --eval   # the parity config's evaluation: 100 held-out prompts, greedy,
                                                     # 32 new tokens: calls of 32 with the prefix on and off, and
                                                     # one call of 100 with it on (the eval stage's batch_tokens)
"""

from __future__ import annotations

import argparse
import statistics
import time

import loopback  # bench/loopback.py: run under .ci/loopback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--eval", action="store_true", help="the common-prefix case (an evaluation) instead")
    args = parser.parse_args()
    if args.eval:
        return evaluation(args.reps, args.threads)

    import torch

    from stages.policy.chat import ChatFormat
    from stages.policy.hf import HFBackend
    from stages.policy.load import load_policy
    from stages.policy.sampling import SamplingConfig
    from storage.schema import Message
    from tasks.base import load_task

    torch.set_num_threads(args.threads)
    model, tokenizer = load_policy("SmolLM2-135M-Instruct", device="cpu")
    chat = ChatFormat(tokenizer)
    for task_name, new_tokens in (("arithmetic", 32), ("doc_search", 96)):
        task = load_task(task_name)
        prompts = []
        for p in task.prompts("train")[:4]:
            text = chat.render([Message(m["role"], m["content"]) for m in task.messages(p)], True)
            prompts += [chat.encode(text)] * args.group
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens)
        backends = {"shared": HFBackend(model, tokenizer, share_prompts=True),
                    "per-row": HFBackend(model, tokenizer, share_prompts=False)}
        times, outs = alternate(backends, args.reps, lambda backend, rep: backend.generate(prompts, sampling, seed=rep))
        a, b = outs["shared"], outs["per-row"]
        differ = sum(x.token_ids != y.token_ids for x, y in zip(a, b))
        lp = 0.0  # over each row's common prefix: after a row's first different token the contexts differ
        for x, y in zip(a, b):
            for p, q, s, t in zip(x.logprobs, y.logprobs, x.token_ids, y.token_ids):
                lp = max(lp, abs(p - q))
                if s != t:
                    break
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{task_name}: prompt {len(prompts[0])} tokens x {len(prompts)} rows, {new_tokens} new tokens; "
              f"per-row prefill {med['per-row']:.2f} s ({', '.join(f'{t:.2f}' for t in times['per-row'])}), "
              f"shared {med['shared']:.2f} s ({', '.join(f'{t:.2f}' for t in times['shared'])}); "
              f"speed-up {med['per-row'] / med['shared']:.2f}x; rows with other tokens {differ}/{len(a)} "
              f"(last rep), max |d logprob| up to each row's first different token {lp:.2e}", flush=True)


def alternate(backends: dict, reps: int, run) -> tuple[dict[str, list[float]], dict]:
    """`run(backend, rep)` for each backend in turn, `reps` times after a warm-up round: (seconds per backend, the
    last round's outputs per backend)."""
    times: dict[str, list[float]] = {k: [] for k in backends}
    outs: dict = {}
    for rep in range(reps + 1):  # rep 0 warms up
        for name, backend in backends.items():
            start = time.perf_counter()
            outs[name] = run(backend, rep)
            if rep:
                times[name].append(time.perf_counter() - start)
    return times, outs


def evaluation(reps: int, threads: int) -> None:
    """The parity config's held-out evaluation (100 distinct prompts, greedy, 32 new tokens): HFBackend with the common
    prefix prefilled once vs a full prefill per row, in calls of 32 rows, and with the prefix once in one call of 100."""
    import torch

    from stages.policy.chat import ChatFormat
    from stages.policy.hf import HFBackend
    from stages.policy.load import load_policy
    from stages.policy.sampling import SamplingConfig
    from storage.schema import Message
    from tasks.base import load_task

    torch.set_num_threads(threads)
    model, tokenizer = load_policy("SmolLM2-135M-Instruct", device="cpu")
    chat = ChatFormat(tokenizer)
    task = load_task("arithmetic", {"digits": 2, "operators": "+", "n_train": 2000, "n_test": 100, "seed": 0})
    prompts = [chat.encode(chat.render([Message(m["role"], m["content"]) for m in task.messages(p)], True))
               for p in task.prompts("test")]
    common = next(i for i in range(min(map(len, prompts))) if len({p[i] for p in prompts}) > 1)
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=32)
    prefix, full = HFBackend(model, tokenizer, share_prefix=True), HFBackend(model, tokenizer, share_prefix=False)
    # (backend, rows per generate call): calls of 32 were the eval stage's before issue 57; one call of all 100 is what
    # its `batch_tokens` gives the parity config now
    variants = {"full prefill": (full, 32), "prefix once": (prefix, 32), "prefix once, one call": (prefix, len(prompts))}
    times, outs = alternate(variants, reps, lambda variant, rep: [
        s for k in range(0, len(prompts), variant[1]) for s in variant[0].generate(prompts[k:k + variant[1]], sampling)])
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"evaluation: {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{common} of them common, greedy, 32 new tokens", flush=True)
    for name, t in times.items():
        differ = sum(x.token_ids != y.token_ids for x, y in zip(outs[name], outs["full prefill"]))
        print(f"  {name} ({variants[name][1]} rows per call): {med[name]:.2f} s ({', '.join(f'{x:.2f}' for x in t)}), "
              f"{med['full prefill'] / med[name]:.2f}x the full prefill; rows with other tokens {differ}/{len(prompts)}",
              flush=True)

if __name__ == "__main__":
    loopback.enter()
    main()
