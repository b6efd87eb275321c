"""What an image costs in the GRPO update of a vision-language policy, and the memory at the most images (issue 34).

    .ci/loopback .venv/bin/python bench/bench_vlm_update.py [--images 0,1,2,4,8] [--length 640] [--repeats 2]
    .ci/loopback .venv/bin/python bench/bench_vlm_update.py --images 0,4 --tower-grads   # before the fix below

The model has SmolVLM-256M's architecture (Idefics3): the SmolLM2-135M text model, a SigLIP-B/16 vision
tower at 512x512 (12 layers, hidden 768, 1024 patches), pixel shuffle by 4 to 64 image tokens per image,
LoRA r=8 on the language model's attention and MLP (the vision tower frozen, as stages.policy.lora.add_vlm_lora
does). Weights are random: the cost of a forward/backward pass does not depend on their values, and no
pretrained VLM can be downloaded here.

Each row trains one sequence of the same `--length` tokens through the real update (`train_on_batch`: the
GRPO loss, backward, optimizer step), 64 of them sampled (mask 1), with k images in the prompt: k x 64 of
the tokens are image placeholders, the rest text. So the rows differ only in how many tokens are images:

    cost of an image token = (t_k - t_0) / (64 k) + t_0 / length     (the vision tower's share + a token's)
    ratio = that / (t_0 / length)                                    (x the cost of a text token)

`--tower-grads` reproduces the update before `set_activation_checkpointing` removed transformers' input-grad
hooks (stages/policy/logprobs.py): the frozen vision tower's output then required grad, so backward ran
through the tower and its activations were kept.

Each row runs in its own child process; `peak MB` is its peak RSS during the updates (the peak is reset
after the model is built: model, optimizer, one micro-batch's activations and pixel inputs), `+MB` that
peak over the resting process before the first update.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import loopback  # bench/loopback.py: run under .ci/loopback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

IMAGE_SIZE, PATCH, SCALE = 512, 16, 4
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2 // SCALE**2  # 64
SAMPLED = 64


def build() -> tuple:
    """The SmolVLM-256M-shaped model (random weights, LoRA on the language model) and its processor."""
    import torch
    from transformers import (AutoConfig, AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration,
                              Idefics3ImageProcessorPil, Idefics3Processor)

    from stages.policy.lora import LoRASettings
    from stages.policy.model import prepare_default_model
    from stages.policy.lora import add_vlm_lora

    smollm = prepare_default_model()
    tok = AutoTokenizer.from_pretrained(smollm)
    tok.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>", "<global-img>"]})
    text = AutoConfig.from_pretrained(smollm).to_dict() | {"vocab_size": len(tok)}
    config = Idefics3Config(
        vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                           image_size=IMAGE_SIZE, patch_size=PATCH),
        text_config=text, image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=SCALE,
        tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config)
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": IMAGE_SIZE},
                                       max_image_size={"longest_edge": IMAGE_SIZE})
    processor = Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=IMAGE_TOKENS,
                                  chat_template="{% for m in messages %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
                                                "<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endfor %}")
    return add_vlm_lora(model, LoRASettings(r=8, alpha=16)), processor


def sample(processor, k: int, length: int):
    """One training sequence of `length` tokens: k images' placeholder blocks, text filling the prompt to
    length - SAMPLED, then SAMPLED sampled tokens (mask 1)."""
    import random

    from PIL import Image

    from stages.policy.vlm import VisionInputs, image_structure_ids
    from stages.update.data import Sample

    rng = random.Random(k)
    pil = [Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), tuple(rng.randrange(256) for _ in range(3))) for _ in range(k)]
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}] * k}], tokenize=False)
    prompt = list(processor(text=[text], images=[pil] if pil else None, add_special_tokens=False)["input_ids"][0]) if k else []
    filler = length - SAMPLED - len(prompt)
    if filler < 0:
        raise SystemExit(f"--length {length} is too short for {k} images ({len(prompt)} prompt tokens)")
    vocab = processor.tokenizer.vocab_size  # the base vocabulary: no image tokens among the text
    ids = prompt + [rng.randrange(vocab) for _ in range(filler + SAMPLED)]
    mask = [0] * (length - SAMPLED) + [1] * SAMPLED
    tensors = dict(processor.image_processor(images=[pil], return_tensors="pt")) if pil else {}
    vision = VisionInputs(tensors, image_structure_ids(processor))
    return Sample(ids, mask, [-1.0 * m for m in mask], vision=vision)


def child(k: int, length: int, repeats: int, tower_grads: bool = False) -> dict:
    import torch

    from stages.update.config import GRPOConfig
    from stages.update.train import make_optimizer, train_on_batch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    model, processor = build()
    s = sample(processor, k, length)
    config = GRPOConfig(lr=1e-5, micro_batch_size=1, micro_batch_tokens=None)
    optimizer = make_optimizer(model, None, config)
    if tower_grads:  # transformers' own enable (it hooks the embeddings); train_on_batch leaves it active
        from stages.policy.logprobs import _causal_lm

        _causal_lm(model).activation_checkpointing_enable({"use_reentrant": False})
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM): the update's own peak from here
    resting = _status_mb("VmRSS")
    times = []
    for _ in range(repeats + 1):  # the first is warm-up
        start = time.perf_counter()
        train_on_batch(model, optimizer, [s], torch.tensor([1.0]), config, temperature=1.0)
        times.append(time.perf_counter() - start)
    n_image = sum(t == processor.tokenizer.convert_tokens_to_ids("<image>") for t in s.token_ids)
    return {"images": k, "image_tokens": n_image, "length": length, "seconds": statistics.median(times[1:]),
            "peak_mb": _status_mb("VmHWM"), "extra_mb": _status_mb("VmHWM") - resting}


def _status_mb(field: str) -> float:
    """A memory field of /proc/self/status (kB there) in MiB."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", default="0,1,2,4,8")
    ap.add_argument("--length", type=int, default=640)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tower-grads", action="store_true", help="the update before the input-grad fix")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.length, args.repeats, args.tower_grads)))
        return
    rows = []
    print(f"SmolVLM-256M-shaped Idefics3 (random weights), {IMAGE_SIZE}px images = {IMAGE_TOKENS} tokens each, "
          f"one sequence of {args.length} tokens ({SAMPLED} sampled) per update, LoRA r=8 on the language model"
          + (", the vision tower backpropagated (--tower-grads)" if args.tower_grads else ""))
    print(f"{'images':>6} {'image tok':>9} {'update s':>9} {'peak MB':>8} {'+MB':>6} {'image token / text token':>25}")
    for k in (int(x) for x in args.images.split(",")):
        argv = ["--child", str(k), "--length", str(args.length), "--repeats", str(args.repeats)]
        argv += ["--tower-grads"] if args.tower_grads else []
        out = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        base = rows[0] if rows[0]["images"] == 0 else None
        ratio = ""
        if base and k:
            per_text = base["seconds"] / base["length"]
            per_image = (row["seconds"] - base["seconds"]) / row["image_tokens"] + per_text
            ratio = f"{per_image / per_text:.2f}x"
        print(f"{k:>6} {row['image_tokens']:>9} {row['seconds']:>9.2f} {row['peak_mb']:>8.0f} {row['extra_mb']:>6.0f} "
              f"{ratio:>25}", flush=True)


if __name__ == "__main__":
    loopback.enter()
    main()
