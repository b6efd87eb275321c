"""Build the small VLM for CPU: SmolLM2-135M-Instruct inside SmolVLM's architecture (Idefics3), with a small
vision tower taught to see the count_shapes pictures by a short SFT.

    .venv/bin/python examples/vision/build_small_vlm.py            # or: make small-vlm
    -> $RLOPS_CACHE/models/SmolVLM-SmolLM2-135M-shapes (default ~/.cache/rlops/...), loadable by VLMPolicy.load

1. Assemble (stages/policy/small_vlm.py): SmolLM2's weights copied unchanged into the text model and lm_head
   (checked: text-only logits equal SmolLM2's), a random SigLIP-style tower and connector.
2. SFT the tower and the connector only (the text model stays frozen, so it remains exactly SmolLM2 and GRPO's
   LoRA later starts from it): cross-entropy on the count_shapes train split's replies ("3<|im_end|>"), the
   task's own system prompt and question. Deliberately short (`--steps`): the starting policy should see
   something but not everything, leaving GRPO room on the held-out split.
3. Save model + processor in one folder (atomically; a `.rlops-complete` marker written last).

Deterministic for a given seed: two builds with `--threads 1` wrote bit-identical weights (sha256 of
model.safetensors). Torch threads: `--threads` (2 by default: the CPU machines rlops runs on have 2 cores).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import time
from pathlib import Path
from typing import Any

from stages.policy.model import DONE_MARKER, prepare_default_model
from stages.policy.small_vlm import NAME, VisionTower, assemble_vlm, save_vlm, text_logit_gap
from stages.policy.vlm import split_images
from storage.settings import cache_dir
from tasks import count_shapes

TASK = dict(size=64, max_count=4)  # the count_shapes task the tower is trained for (configs/visual_learn.yaml)


def sft_rows(processor: Any, n: int, seed: int) -> list[dict[str, Any]]:
    """The first `n` train prompts as training rows: `ids` (prompt + reply + <|im_end|>), `n_prompt`, `pixels`."""
    from PIL import Image

    task = count_shapes.make_task(**TASK, n_train=n, n_test=100, seed=seed)
    rows = []
    for prompt in task.prompts("train"):
        chat, images = split_images(task.messages(prompt))
        text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        pil = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
        enc = processor(text=[text], images=[pil], add_special_tokens=False, return_tensors="pt")
        reply = processor.tokenizer.encode(count_shapes.reply(prompt.metadata) + "<|im_end|>", add_special_tokens=False)
        ids = enc["input_ids"][0].tolist()
        rows.append({"ids": ids + reply, "n_prompt": len(ids), "pixels": enc["pixel_values"][0],  # (1, 3, H, W)
                     "answer": prompt.metadata["answer"]})
    return rows


def pretrain_tower(model: Any, rows: list[dict[str, Any]], *, steps: int, batch_size: int, lr: float,
                   seed: int) -> list[float]:
    """Teach the vision tower and connector to see the count before they meet the language model: a linear probe
    on the connector's mean image token predicts the count (cross-entropy; the probe is thrown away). No language
    model pass, so a step costs ~1/50 of an SFT step: what makes a tower trained from scratch affordable on CPU."""
    import torch

    tower = [p for n, p in model.named_parameters() if n.startswith(("model.vision_model.", "model.connector."))]
    probe = torch.nn.Linear(model.config.text_config.hidden_size, max(r["answer"] for r in rows) + 1)
    opt = torch.optim.AdamW(tower + list(probe.parameters()), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    model.train()
    losses = []
    for step in range(steps):
        batch = rng.sample(rows, batch_size)
        pixels = torch.stack([r["pixels"] for r in batch])  # (B, 1, 3, H, W)
        tokens = torch.stack(model.model.get_image_features(pixel_values=pixels).pooler_output)  # (B, seq, hidden)
        logits = probe(tokens.mean(1))  # (B, classes)
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor([r["answer"] for r in batch]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if (step + 1) % 50 == 0:
            accuracy = (logits.argmax(-1) == torch.tensor([r["answer"] for r in batch])).float().mean().item()
            print(f"pretrain step {step + 1:4d}  loss {losses[-1]:.4f}  batch accuracy {accuracy:.3f}", flush=True)
    model.eval()
    return losses


def batch_loss(model: Any, rows: list[dict[str, Any]], pad_id: int) -> Any:
    """Mean cross-entropy of the replies' tokens (right-padded batch; prompt and padding not scored)."""
    import torch

    width = max(len(r["ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_id)  # (B, T)
    labels = torch.full((len(rows), width), -100)  # (B, T)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["ids"])] = torch.tensor(r["ids"])
        labels[i, r["n_prompt"]: len(r["ids"])] = torch.tensor(r["ids"][r["n_prompt"]:])
        mask[i, : len(r["ids"])] = 1
    pixels = torch.stack([r["pixels"] for r in rows])  # (B, 1, 3, H, W)
    return model(input_ids=ids, attention_mask=mask, pixel_values=pixels, labels=labels).loss


def val_accuracy(model: Any, rows: list[dict[str, Any]], tokenizer: Any) -> float:
    """The fraction of `rows` whose greedy first reply token is the right count (all prompts are equally long)."""
    import torch

    ids = torch.tensor([r["ids"][: r["n_prompt"]] for r in rows])  # (B, P)
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=torch.stack([r["pixels"] for r in rows])).logits[:, -1]  # (B, V)
    return sum(tokenizer.decode(int(t)).strip() == tokenizer.decode(r["ids"][r["n_prompt"]]).strip()
               for t, r in zip(logits.argmax(-1), rows)) / len(rows)


def train_tower(model: Any, rows: list[dict[str, Any]], val: list[dict[str, Any]], tokenizer: Any, *, steps: int,
                batch_size: int, lr: float, seed: int, stop_at: float, eval_every: int) -> list[float]:
    """AdamW on the vision tower and connector only (linear warmup then cosine over `steps`); stops early once the
    greedy accuracy on `val` (train-split prompts never trained on) reaches `stop_at`. Returns the loss per step."""
    import math

    import torch

    for name, p in model.named_parameters():
        p.requires_grad = name.startswith(("model.vision_model.", "model.connector."))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup))))
    rng = random.Random(seed)
    model.train()
    losses = []
    for step in range(steps):
        loss = batch_loss(model, rng.sample(rows, batch_size), tokenizer.pad_token_id)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if (step + 1) % eval_every == 0:
            model.eval()
            accuracy = val_accuracy(model, val, tokenizer)
            model.train()
            print(f"step {step + 1:4d}  loss {losses[-1]:.4f}  val accuracy {accuracy:.3f}", flush=True)
            if accuracy >= stop_at:
                break
    model.eval()
    for p in model.parameters():
        p.requires_grad = True
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=cache_dir() / "models" / NAME)
    parser.add_argument("--pretrain-steps", type=int, default=600, help="steps of the count probe on the tower alone")
    parser.add_argument("--pretrain-batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200, help="the most SFT steps (the cosine schedule's length)")
    parser.add_argument("--stop-at", type=float, default=0.5,
                        help="stop once greedy accuracy on held-back train prompts reaches this (short on purpose)")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--n-val", type=int, default=64, help="train prompts held back from SFT to decide when to stop")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4, help="both stages (1e-3 did not learn from scratch)")
    parser.add_argument("--n-train", type=int, default=1000, help="count_shapes train prompts to sample batches from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    args = parser.parse_args()
    if (args.out / DONE_MARKER).exists() and not args.force:
        print(f"{args.out} is already built (--force rebuilds it)")
        return

    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)  # the count probe's initial weights come from the global generator
    text_dir = prepare_default_model()
    model, processor = assemble_vlm(text_dir, VisionTower(), seed=args.seed)
    gap = text_logit_gap(model, text_dir, "What is the capital of France?")
    if gap > 1e-5:
        raise RuntimeError(f"the assembled text model differs from SmolLM2 by {gap} in the logits")
    rows = sft_rows(processor, args.n_train + args.n_val, args.seed)
    start = time.perf_counter()
    pretrain = pretrain_tower(model, rows[: args.n_train], steps=args.pretrain_steps,
                              batch_size=args.pretrain_batch_size, lr=args.lr, seed=args.seed)
    pretrain_seconds = time.perf_counter() - start
    start = time.perf_counter()
    losses = train_tower(model, rows[: args.n_train], rows[args.n_train:], processor.tokenizer, steps=args.steps,
                         batch_size=args.batch_size, lr=args.lr, seed=args.seed, stop_at=args.stop_at,
                         eval_every=args.eval_every)
    seconds = time.perf_counter() - start
    gap = text_logit_gap(model, text_dir, "What is the capital of France?")  # the text model stayed frozen
    out = save_vlm(model, processor, args.out)
    recipe = {"text_model": str(text_dir), "tower": VisionTower().__dict__, "task": TASK, "pretrain_steps": args.pretrain_steps,
              "pretrain_batch_size": args.pretrain_batch_size, "pretrain_seconds": round(pretrain_seconds, 1),
              "pretrain_final_loss": pretrain[-1] if pretrain else None, "max_steps": args.steps,
              "steps": len(losses), "stop_at": args.stop_at, "n_val": args.n_val,
              "batch_size": args.batch_size, "lr": args.lr, "n_train": args.n_train, "seed": args.seed,
              "sft_seconds": round(seconds, 1), "final_loss": losses[-1], "text_logit_gap": gap}
    (out / "build.json").write_text(json.dumps(recipe, indent=1) + "\n")
    (out / DONE_MARKER).write_text("ok\n")
    print(json.dumps(recipe, indent=1))


if __name__ == "__main__":
    main()
