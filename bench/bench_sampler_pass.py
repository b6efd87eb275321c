"""The HF backend's sampler and log-prob recorder, before and after issue 57's fifth stop, on the parity config's
rollout step: in turns in one process, fp32 and bf16 weights (LoRA r=16 on q/k/v/o, its weights fp32), the same
seeds.

Before: the sampler took a float64 softmax of the step's (B, V) scores, its cumulative sum, drew, and the recorder took
a float32 logsumexp of the same scores at the next step (~8 passes over (32, 49152)). After: the sampler sums exp(z -
max) cumulatively in place and hands the recorder each row's log-normaliser (4 passes, none in the recorder). The same
draws from the same distribution; a pick can differ only where a uniform falls within float64 rounding of a boundary.

    .ci/loopback .venv/bin/python bench/bench_sampler_pass.py [--reps 3] [--threads 2]

Prints the step's median seconds per variant, whether the two drew the same tokens, and the largest difference of
their recorded log-probs; and the passes alone on a (32, 49152) score tensor.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import loopback  # bench/loopback.py: run under .ci/loopback
from bench_sample_dtype import parity_step


class OldSampler:
    """stages/policy/hf.py's `_InverseCDFSampler` before this stop (the recorder then ran its own logsumexp)."""

    def __init__(self, temperature: float, recorder: Any = None) -> None:
        self.temperature = temperature

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        z = scores.double()
        if self.temperature != 1.0:
            z = z / self.temperature
        cdf = torch.softmax(z, dim=-1).cumsum(-1)
        u = torch.rand(cdf.shape[0], 1, dtype=torch.float64, device=cdf.device) * cdf[:, -1:]
        pick = torch.searchsorted(cdf, u, right=True).clamp(max=cdf.shape[1] - 1)
        return torch.full_like(scores, float("-inf")).scatter_(1, pick, 0.0)


def passes_alone(reps: int = 50) -> dict[str, float]:
    """ms per decoding step of the sampler + recorder alone on (32, 49152) scores, old and new."""
    import torch

    from stages.policy.processors import _InverseCDFSampler, _LogprobRecorder

    scores = torch.randn(32, 49152) * 3
    out = {}
    for name, sampler_cls in (("before", OldSampler), ("after", _InverseCDFSampler)):
        recorder = _LogprobRecorder(1.0)
        sampler = sampler_cls(1.0, recorder)
        last = torch.zeros(32, 1, dtype=torch.long)
        start = time.perf_counter()
        for _ in range(reps):
            recorder(last, scores)
            last = sampler(last, scores).argmax(-1, keepdim=True)
        recorder.finish(last[:, 0])
        out[name] = (time.perf_counter() - start) / reps * 1000
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    from stages.policy import hf
    from stages.policy.lora import LoRASettings, add_lora

    model, tokenizer, rows, sampling = parity_step(args.threads)
    new_sampler = hf._InverseCDFSampler
    print("sampler + recorder alone, (32, 49152), ms per decoding step:",
          {k: round(v, 2) for k, v in passes_alone().items()}, flush=True)
    lora = LoRASettings(r=16, alpha=32, dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    models = {"fp32": add_lora(copy.deepcopy(model), lora).eval(),
              "bf16": add_lora(copy.deepcopy(model).to(torch.bfloat16), lora).eval()}
    for name, m in models.items():
        times: dict[str, list[float]] = {"before": [], "after": []}
        outs: dict[str, list[Any]] = {}
        for rep in range(args.reps + 1):  # rep 0 warms up
            for variant, cls in (("before", OldSampler), ("after", new_sampler)):
                hf._InverseCDFSampler = cls
                try:
                    start = time.perf_counter()
                    outs[variant] = hf.HFBackend(m, tokenizer).generate(rows, sampling, seed=rep)
                    if rep:
                        times[variant].append(time.perf_counter() - start)
                finally:
                    hf._InverseCDFSampler = new_sampler
        same = [a.token_ids == b.token_ids for a, b in zip(outs["before"], outs["after"])]
        gap = max((abs(x - y) for a, b in zip(outs["before"], outs["after"]) if a.token_ids == b.token_ids
                   for x, y in zip(a.logprobs, b.logprobs)), default=0.0)
        before, after = statistics.median(times["before"]), statistics.median(times["after"])
        print(f"{name}: before {before:.2f} s ({', '.join(f'{t:.2f}' for t in times['before'])}), "
              f"after {after:.2f} s ({', '.join(f'{t:.2f}' for t in times['after'])}) per step: {before / after:.2f}x; "
              f"the same tokens in {sum(same)}/{len(same)} rows, recorded log-probs within {gap:.2e}", flush=True)


if __name__ == "__main__":
    loopback.enter()
    main()
