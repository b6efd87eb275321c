"""GPU check: a 3-step pipeline (rollout -> score -> GRPO) of SmolLM2-135M-Instruct on one GPU, with
the vLLM backend.

    bash bench/gpu_check.sh          # installs vllm, prepares the model, runs this

What it exercises: one resident vLLM engine for the whole run (adapters hot-swapped per step,
stages/policy/vllm.py), asleep while GRPO trains on the same GPU; GRPO in bf16 autocast with fp32 LoRA
weights. What it prints: the time of each step, generation tokens/s per step, and how well vLLM's
behaviour log-probs agree with the trainer's log-probs of the same policy on the same tokens
(mean |Δ| and the share of tokens with |Δ| > 1e-2): that gap is what the importance ratio of the
first GRPO pass sees instead of 1.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import loopback  # bench/loopback.py: run under .ci/loopback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def logprob_agreement(ws, batch_id: str, temperature: float) -> tuple[float, float, int]:
    """(mean |Δ|, share of tokens with |Δ| > 1e-2, tokens) between the stored behaviour log-probs of a
    batch and the trainer's log-probs of the policy that sampled it (fp32 weights, bf16 autocast)."""
    import torch

    from stages.common import resolve_policy
    from stages.policy.logprobs import token_logprobs
    from stages.update.config import GRPOConfig
    from stages.update.train import _load_trainable
    from storage.checkpoints import local_copy
    from storage.schema import Rollout, from_table

    rows = from_table(ws.read_artifact(batch_id), Rollout)
    base_model, adapter = resolve_policy(ws, rows[0].policy_id)
    model = _load_trainable(base_model, local_copy(adapter), GRPOConfig().lora).eval()
    deltas = []
    for r in rows:
        ids = torch.tensor([r.token_ids], device="cuda")
        mask = torch.tensor([r.loss_mask], device="cuda").bool()
        mask[:, 0] = False
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            lp = token_logprobs(model, ids, torch.ones_like(ids), mask, temperature)  # (1, T)
        want = torch.tensor([r.behavior_logprobs], device="cuda")
        deltas.append((lp[mask].float() - want[mask]).abs().cpu())
    d = torch.cat(deltas)
    del model
    torch.cuda.empty_cache()
    return float(d.mean()), float((d > 1e-2).float().mean()), d.numel()


def main() -> None:
    import torch

    from flows import pipeline
    from flows.run_config import from_dict
    from stages.common import StageContext
    from stages.policy import vllm as engine
    from stages.policy.model import prepare_default_model
    from storage.workspace import Workspace

    assert torch.cuda.is_available(), "no CUDA device"
    prepare_default_model()
    cfg = from_dict({
        "name": "gpu-check", "task": {"name": "arithmetic"}, "steps": 3,
        "rollout": {"backend": "vllm", "prompts_per_step": 16, "group_size": 8, "max_new_tokens": 64,
                    "groups_per_shard": 16},
        "score": {"rewards": [{"name": "correct", "fn": "rewards.builtin.numeric_match"}]},
        "grpo": {"lr": 1e-4, "micro_batch_size": 32, "micro_batch_tokens": None},
        "eval": {"n_prompts": 32, "every": 3, "metric": "correct"},
    })
    ws = Workspace.open(Path(tempfile.mkdtemp()) / "ws")
    marks: list[float] = [time.perf_counter()]

    def on_step(row: dict) -> None:
        if "step" in row:
            marks.append(time.perf_counter())
            print(f"step {row['step']}: {marks[-1] - marks[-2]:.1f} s (incl. engine start on the first), "
                  f"reward_mean {row['reward_mean']:.3f}", flush=True)
        else:
            marks[-1] = time.perf_counter()  # evaluations are not part of a step's time

    result = pipeline.train(cfg, StageContext(ws, run_name="gpu-check"), on_step=on_step)
    print(f"vLLM engines built in this run: {len(engine._RESIDENT)} (one per base model, reused by every step)")
    for step, batch in enumerate(result.batches):
        metrics = ws.catalog.get_artifact(batch)["meta"]["metrics"]
        mean, share, n = logprob_agreement(ws, batch, cfg.rollout.temperature)
        print(f"step {step}: generation {metrics['tokens_per_s']:.0f} sampled tok/s; vLLM vs trainer log-probs over "
              f"{n} tokens: mean |Δ| {mean:.4f}, |Δ| > 1e-2 on {share:.1%}")
    print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB (this process's torch allocations)")


if __name__ == "__main__":
    loopback.enter()
    main()
