"""rlops' own GPU paths on one NVIDIA GPU, without vLLM: what runs on a machine whose Python has torch,
transformers and peft but no vLLM (bench/gpu_check.sh needs `pip install '.[vllm]'` from a registry).

1. Sampling: `HFBackend` (stages/policy/hf.py) samples 8 groups of 8 on cuda from a model loaded by
   `load_policy` (bf16 on cuda): tokens/s, and its behaviour log-probs against `token_logprobs` recomputed on
   the same tokens by the same bf16 model, and by the model in fp32 (what the update's autocast sees).
2. The update: `train_on_batch` (stages/update/train.py) on those samples on cuda (fp32 weights under bf16
   autocast) and the same step on CPU in fp32, from the same LoRA initialisation: the adapters' difference
   after one step, the first pass's ratio, and seconds per step.

The model: random weights in SmolLM2-135M's architecture (its config.json) with SmolLM2's tokenizer, both
read from --model-files (a folder with config.json and the tokenizer files: no weights travel).

    python bench/gpu_paths.py --model-files DIR
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def _random_model(files: Path, out: Path) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(files)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(files).save_pretrained(out)
    return str(out)


def _samples(backend, tok, groups: int, group_size: int, new_tokens: int):
    from stages.policy.sampling import SamplingConfig

    questions = [f"What is {a} + {b}? Answer with the number." for a, b in zip(range(10, 10 + groups), range(3, 3 + groups))]
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in questions]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    rows = [p for p in prompts for _ in range(group_size)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens)
    backend.generate(rows[:group_size], sampling, seed=1)  # warm-up: kernels, allocator
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = backend.generate(rows, sampling, seed=0)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return rows, out, seconds


def _recomputed(model, rows, out) -> torch.Tensor:
    from stages.policy.logprobs import token_logprobs

    gaps = []
    for prompt, s in zip(rows, out):
        ids = torch.tensor([prompt + s.token_ids], device=model.device)
        mask = torch.zeros_like(ids)
        mask[0, len(prompt):] = 1
        with torch.no_grad():
            logp = token_logprobs(model, ids, torch.ones_like(ids), mask, 1.0)[0, len(prompt):]
        gaps.append((logp.float().cpu() - torch.tensor(s.logprobs)).abs())
    return torch.cat(gaps)


def _stats(gaps: torch.Tensor) -> dict[str, float]:
    return {"mean": float(gaps.mean()), "max": float(gaps.max()), "over_1e-2": float((gaps > 1e-2).float().mean())}


def _update(path: str, samples, advantages, device: str, seconds: list[float]):
    from stages.policy.lora import add_lora
    from stages.update.config import GRPOConfig
    from stages.update.train import load_base, make_optimizer, train_on_batch

    config = GRPOConfig(lr=1e-4)
    torch.manual_seed(0)
    model = add_lora(load_base(path, device), config.lora)  # the same A initialisation on both devices
    optimizer = make_optimizer(model, None, config)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    metrics = train_on_batch(model, optimizer, samples, advantages, config, temperature=1.0)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds.append(time.perf_counter() - start)
    state = {k: v.detach().float().cpu() for k, v in model.named_parameters() if v.requires_grad}
    return state, metrics[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-files", type=Path, required=True)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "no GPU: this check is for a machine with one"

    from stages.policy.hf import HFBackend
    from stages.policy.load import load_policy
    from stages.update.data import Sample
    from stages.update.loss import group_advantages

    report: dict[str, object] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    path = _random_model(args.model_files, Path(tempfile.mkdtemp()) / "smollm2-arch")
    model, tok = load_policy(path)  # bf16 on cuda
    report["sampling_dtype"] = str(next(model.parameters()).dtype)
    rows, out, seconds = _samples(HFBackend(model, tok), tok, args.groups, args.group_size, args.new_tokens)
    tokens = sum(len(s.token_ids) for s in out)
    report["sampling"] = {"rows": len(rows), "tokens": tokens, "seconds": round(seconds, 3),
                          "tokens_per_s": round(tokens / seconds, 1)}
    report["behaviour_vs_bf16_recompute"] = _stats(_recomputed(model, rows, out))
    fp32, _ = load_policy(path, dtype="float32")
    report["behaviour_vs_fp32_recompute"] = _stats(_recomputed(fp32, rows, out))
    del model, fp32
    torch.cuda.empty_cache()

    samples = [Sample(p + s.token_ids, [0] * len(p) + [1] * len(s.token_ids), [0.0] * len(p) + s.logprobs)
               for p, s in zip(rows, out)]
    # The parity of the sampled ids' sum: signal in most groups (a random model's samples all run to the length
    # limit, so their length has none).
    rewards = torch.tensor([float(sum(s.token_ids) % 2) for s in out])
    advantages = group_advantages(rewards, [i // args.group_size for i in range(len(out))])
    seconds_per_step: dict[str, list[float]] = {"cuda": [], "cpu": []}
    cuda_state, cuda_metrics = _update(path, samples, advantages, "cuda", seconds_per_step["cuda"])
    _update(path, samples, advantages, "cuda", seconds_per_step["cuda"])  # a second, warm step
    cpu_state, cpu_metrics = _update(path, samples, advantages, "cpu", seconds_per_step["cpu"])
    diffs = [float((cuda_state[k] - cpu_state[k]).abs().max()) for k in cpu_state]
    moved = [float(cpu_state[k].abs().max()) for k in cpu_state if "lora_B" in k]
    report["update"] = {"seconds_cuda_first_warm": [round(s, 3) for s in seconds_per_step["cuda"]],
                        "seconds_cpu": round(seconds_per_step["cpu"][0], 3),
                        "adapter_max_abs_diff_cuda_bf16_vs_cpu_fp32": max(diffs),
                        "lora_B_max_abs_cpu": max(moved),
                        "metrics_cuda": cuda_metrics, "metrics_cpu": cpu_metrics}
    print(json.dumps(report, indent=1, default=float))


if __name__ == "__main__":
    main()
