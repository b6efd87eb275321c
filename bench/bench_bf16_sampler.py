"""The bf16 sampler as a run holds it: SmolLM2-135M-Instruct with a LoRA adapter (r=16 on q/k/v/o, as the parity
config trains), the parity step's sampling (4 prompts x 8, T=1, 32 new tokens) and its evaluation (the 100 held-out
prompts, greedy, one call), in fp32, in bf16 with generate's first-step slice handed to the output layer as it is,
and in bf16 with that slice made contiguous (stages/policy/hf.py `_contiguous_head`, what rlops does), in turns.

    .ci/loopback .venv/bin/python bench/bench_bf16_sampler.py [--reps 3]

The evaluation's 100 distinct prompts share the system prompt: it is prefilled once and generate prefills each row's
own tail, so generate's first step computes logits at a (100, 1, 576) slice of (100, tail, 576) hidden states. For
bf16 on a CPU torch's matmul then copies the output weight once per row. Also prints whether each bf16 variant's
greedy answers equal the others'.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import loopback  # bench/loopback.py: run under .ci/loopback


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    import torch

    from stages.policy.chat import ChatFormat
    from stages.policy.hf import HFBackend
    from stages.policy.load import load_policy
    from stages.policy.lora import LoRASettings, add_lora
    from stages.policy.sampling import SamplingConfig
    from storage.schema import Message
    from tasks.base import load_task

    torch.set_num_threads(2)
    model, tokenizer = load_policy("SmolLM2-135M-Instruct", device="cpu")
    chat = ChatFormat(tokenizer)
    task = load_task("arithmetic", {"digits": 2, "operators": "+", "n_train": 2000, "n_test": 100, "seed": 0})

    def encode(prompt) -> list[int]:
        return chat.encode(chat.render([Message(m["role"], m["content"]) for m in task.messages(prompt)], True))

    step = [encode(p) for p in task.prompts("train")[:4] for _ in range(8)]
    held_out = [encode(p) for p in task.prompts("test")[:100]]
    lora = LoRASettings(r=16, alpha=32, dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    variants = {"fp32": add_lora(copy.deepcopy(model), lora),
                "bf16, slice as is": add_lora(copy.deepcopy(model).to(torch.bfloat16), lora),
                "bf16, slice contiguous": add_lora(copy.deepcopy(model).to(torch.bfloat16), lora)}
    variants["bf16, slice as is"].get_output_embeddings()._rlops_contiguous = True  # as if already done: no hook
    times: dict[str, dict[str, list[float]]] = {k: {"step": [], "evaluation": []} for k in variants}
    answers: dict[str, list[list[int]]] = {}
    for rep in range(args.reps + 1):  # rep 0 warms up
        for name, m in variants.items():
            m.eval()
            backend = HFBackend(m, tokenizer)
            start = time.perf_counter()
            backend.generate(step, SamplingConfig(temperature=1.0, max_new_tokens=32), seed=rep)
            middle = time.perf_counter()
            out = backend.generate(held_out, SamplingConfig(temperature=0.0, max_new_tokens=32))
            if rep:
                times[name]["step"].append(middle - start)
                times[name]["evaluation"].append(time.perf_counter() - middle)
            answers[name] = [s.token_ids for s in out]
    base = {k: statistics.median(v) for k, v in times["fp32"].items()}
    for name, t in times.items():
        print(f"{name}: " + "; ".join(f"{k} median {statistics.median(v):.2f} s ({', '.join(f'{x:.2f}' for x in v)}), "
                                      f"{base[k] / statistics.median(v):.2f}x fp32" for k, v in t.items()))
    same = answers["bf16, slice as is"] == answers["bf16, slice contiguous"]
    print(f"bf16 greedy answers, slice as is vs contiguous: {'the same' if same else 'different'} on the 100 prompts")


if __name__ == "__main__":
    loopback.enter()
    main()
