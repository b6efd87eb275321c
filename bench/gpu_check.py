"""GPU check of the vLLM backend: a small rollout batch of SmolLM2-135M with a LoRA adapter.

    bash bench/gpu_check.sh          # installs vllm, prepares the model, runs this

Builds a fresh LoRA adapter (r=16, q/k/v/o, non-zero B so it changes outputs), registers it as
a checkpoint, runs the rollout stage with `backend: vllm` on 8 arithmetic prompts x G=8, checks
that behaviour log-probs agree with a transformers forward pass of the same policy on the stored
tokens, and prints completion tokens/s.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from stages import rollout
    from stages.common import StageContext, base_policy
    from stages.logprobs import token_logprobs
    from stages.model import prepare_default_model
    from storage.schema import Rollout, from_table
    from storage.workspace import Workspace

    base = str(prepare_default_model())
    ws = Workspace.open(Path(tempfile.mkdtemp()) / "ws")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                                  init_lora_weights=False))
    adapter = ws.root / "checkpoints" / "gpu-check-adapter"
    peft_model.save_pretrained(adapter)
    parent = base_policy(ws, base)
    ws.catalog.add_checkpoint({"policy_id": "ck-gpucheck", "parent_id": parent, "base_model": base, "kind": "grpo",
                               "adapter_uri": str(adapter), "step": 1, "trained_on": {}, "config_hash": "gpu"})
    ws.catalog.complete_artifact("ck-gpucheck", "checkpoint", "grpo", [parent], "gpu")

    cfg = rollout.RolloutConfig(backend="vllm", prompts_per_step=8, group_size=8, max_new_tokens=64, groups_per_shard=8)
    task = rollout.TaskSpec(name="arithmetic")
    t0 = time.perf_counter()
    ref = rollout.run(cfg, StageContext(ws, run_name="gpu-check"), "ck-gpucheck", task)
    seconds = time.perf_counter() - t0
    rows = from_table(ws.read_artifact(ref.id), Rollout)
    sampled = sum(sum(r.loss_mask) for r in rows)
    print(f"vllm rollout: {len(rows)} episodes, {sampled} sampled tokens in {seconds:.1f} s "
          f"(incl. engine start) = {sampled / seconds:.0f} tok/s")

    device = "cuda"
    peft_model = peft_model.to(device).eval()
    worst = 0.0
    for r in rows[:16]:
        ids = torch.tensor([r.token_ids], device=device)
        mask = torch.tensor([r.loss_mask], device=device).bool()
        with torch.no_grad():
            lp = token_logprobs(peft_model, ids, torch.ones_like(ids), mask, temperature=cfg.temperature)
        got = lp[mask].cpu()
        want = torch.tensor(r.behavior_logprobs)[torch.tensor(r.loss_mask).bool()]
        worst = max(worst, (got - want).abs().max().item())
    print(f"max |vllm behaviour log-prob - transformers log-prob| over 16 episodes: {worst:.4f}")
    print("OK" if worst < 0.05 else "MISMATCH: check logprobs_mode / LoRA loading")


if __name__ == "__main__":
    main()
