"""What a cheaper sampler would buy on a CPU: the parity config's rollout step with the policy's weights in fp32 (what
rlops samples with), int8 (torch's dynamic quantization of every Linear layer) and bf16, in turns in one process; and how
far each one's recorded log-probs are from the fp32 policy's on the same tokens (what the update's importance ratio
would have to absorb).

    .ci/loopback .venv/bin/python bench/bench_sample_dtype.py [--reps 3] [--threads 2]

SmolLM2-135M-Instruct (the base: no adapter), 4 train prompts of the parity task x 8 samples, T=1, at most 32 new tokens,
the HF backend. Not a feature: issue 57's measurement of where the next factor of the parity run's time could come from
(sampling is 219 s of its 369 s, each decoding step reading all 540 MB of fp32 weights for 32 rows).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import loopback  # bench/loopback.py: run under .ci/loopback


def parity_step(threads: int) -> tuple[Any, Any, list[list[int]], Any]:
    """The parity config's sampling step on the default model (fp32, no adapter): (model, tokenizer, its 32 prompt rows:
    4 train prompts x 8 samples, its SamplingConfig: T=1, <= 32 new tokens), torch on `threads` threads."""
    import torch

    from stages.policy.chat import ChatFormat
    from stages.policy.load import load_policy
    from stages.policy.sampling import SamplingConfig
    from storage.schema import Message
    from tasks.base import load_task

    torch.set_num_threads(threads)
    model, tokenizer = load_policy("SmolLM2-135M-Instruct", device="cpu")
    chat = ChatFormat(tokenizer)
    task = load_task("arithmetic", {"digits": 2, "operators": "+", "n_train": 2000, "n_test": 100, "seed": 0})
    prompts = [chat.encode(chat.render([Message(m["role"], m["content"]) for m in task.messages(p)], True))
               for p in task.prompts("train")[:4]]
    return model, tokenizer, [p for p in prompts for _ in range(8)], SamplingConfig(temperature=1.0, max_new_tokens=32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    from stages.policy.hf import HFBackend
    from stages.policy.logprobs import token_logprobs

    model, tokenizer, rows, sampling = parity_step(args.threads)
    models = {"fp32": model,
              "int8 (dynamic)": torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear},
                                                                       dtype=torch.qint8),
              "bf16": copy.deepcopy(model).to(torch.bfloat16)}
    times: dict[str, list[float]] = {k: [] for k in models}
    outs = {}
    for rep in range(args.reps + 1):  # rep 0 warms up
        for name, m in models.items():
            start = time.perf_counter()
            outs[name] = HFBackend(m, tokenizer).generate(rows, sampling, seed=rep)
            if rep:
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["fp32"])
    for name, samples in outs.items():
        gaps = []
        for prompt, s in zip(rows, samples):  # the fp32 policy's log-probs of the tokens this sampler drew
            ids = torch.tensor([prompt + s.token_ids])
            mask = torch.tensor([[0] * len(prompt) + [1] * len(s.token_ids)])
            with torch.no_grad():
                fp32 = token_logprobs(model, ids, torch.ones_like(ids), mask)[0, len(prompt):]
            gaps += (fp32 - torch.tensor(s.logprobs)).abs().tolist()
        med = statistics.median(times[name])
        print(f"{name}: median {med:.2f} s per step ({', '.join(f'{t:.2f}' for t in times[name])}), "
              f"{base / med:.2f}x fp32; |log p_fp32 - log p_recorded| over {len(gaps)} sampled tokens: "
              f"mean {statistics.mean(gaps):.4f}, max {max(gaps):.3f}", flush=True)


if __name__ == "__main__":
    loopback.enter()
    main()
