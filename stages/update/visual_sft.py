"""SFT of a vision-language policy on chat demonstrations with images: tokens, masks, pixels and the loop.

    policy = VLMPolicy(add_vlm_lora(base.model, config.lora, seed=config.seed), base.processor, store)
    samples = [demonstration_sample(policy, c, config.max_length) for c in conversations]
    metrics = train_visual_sft(policy.model, train, held_out, config, log=lambda step, row: ...)

A demonstration is OpenAI chat messages whose user, system and tool contents may hold `image_url` parts with
base64 data URLs (so the data file's content hash, the SFT checkpoint's identity, covers its images). Each image
is validated and stored in the workspace's store, and the conversation is tokenised as a rollout is grown
(`VisualChatFormat`, the processor's own chat template with each image expanded into its placeholder tokens):
the text before each assistant message and the template's text after its end-of-turn token are mask 0, the
assistant's reply and its end-of-turn token mask 1, so the model learns to stop as the text SFT teaches it.
Image placeholder tokens are prompt tokens: never in the loss. Pixel inputs are rebuilt from the stored bytes by
the processor, as GRPO rebuilds them (`VLMPolicy.vision_inputs`).

Why not TRL's SFTTrainer, which the text SFT drives: its vision collator re-tokenises with the processor and
needs `{% generation %}` markers in the processor's template for an assistant-only loss (TRL patches only the
templates it knows; Idefics3's and this project's are not among them), its PEFT config would put the LoRA on
the vision tower's q/k/v too, and its loss scores every position. This loop is the project's own update path:
`stages.update.train`'s micro-batches (right padding, stacked images) and `visual_token_logprobs` (the
multimodal body once, the LM head only at trained positions), with what TRL's defaults do around it (AdamW,
linear decay to 0, gradient clipping at 1, a token mean over each optimizer step's tokens).

torch and transformers are imported inside the functions that need them.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from stages.policy.chat import difference
from stages.policy.vlm_chat import VisualChatFormat, image_ids_of, marked_content
from stages.update.data import Sample
from storage.schema import Message

if TYPE_CHECKING:
    from stages.policy.vlm import VLMPolicy


class SFTSchedule(Protocol):
    """What the loop reads of the SFT stage's config (`stages.sft.SFTConfig`, a layer above this one)."""

    lr: float
    epochs: float
    max_steps: int | None
    batch_size: int
    grad_accum: int
    seed: int


def demonstration_sample(policy: VLMPolicy, conversation: list[dict[str, Any]], max_length: int) -> Sample:
    """One demonstration as a training sample: its tokens (image placeholders expanded), the assistant mask, and
    its images' pixel inputs. ValueError before any compute: an image that does not decode or is not a data URL,
    an image in an assistant message, no assistant message, or `max_length` cutting into an image's tokens."""
    chat = VisualChatFormat(policy.processor, policy.store)
    messages = [_record(m, policy) for m in conversation]
    ids: list[int] = []
    mask: list[int] = []
    done = ""  # the rendered conversation so far
    for i, m in enumerate(messages):
        if m.role != "assistant":
            continue
        prompt = chat.encode(difference(done, chat.render(messages[:i], True)))
        reply = chat.encode(m.content or "")
        end = chat.encode(chat.end_of_turn(messages[:i], m))
        stop = next((k + 1 for k, t in enumerate(end) if t in policy.eos_ids), 0)  # through the end-of-turn token
        ids += prompt + reply + end
        mask += [0] * len(prompt) + [1] * (len(reply) + stop) + [0] * (len(end) - stop)
        done = chat.render(messages[: i + 1], False)
    if not any(mask):
        raise ValueError("a demonstration has no assistant message to learn from")
    banned = set(policy.banned_ids)
    if any(t in banned for t in ids[max_length:]):
        raise ValueError(f"a demonstration's image tokens reach past max_length {max_length} ({len(ids)} tokens): "
                         "raise max_length or shorten it")
    ids, mask = ids[:max_length], mask[:max_length]  # the end is cut, as the text SFT cuts it
    return Sample(ids, mask, [0.0] * len(ids), vision=policy.vision_inputs(image_ids_of(messages)))


def _record(message: dict[str, Any], policy: VLMPolicy) -> Message:
    """A demonstration message as a record (images stored, written as references); ValueError for an assistant
    message with an image: what the model writes is text."""
    content = message.get("content")
    if message["role"] == "assistant" and isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") != "text" for p in content):
        raise ValueError("an assistant message in a demonstration may hold text only, not images")
    return Message(message["role"], marked_content(content, policy.store))


def demonstration_loss(model: Any, samples: list[Sample], batch_size: int) -> float:
    """The mean negative log-likelihood per trained token of `samples` (no gradients, dropout off)."""
    import torch

    model.eval()
    with torch.no_grad():
        total, tokens = 0.0, 0
        for b in _batches(model, samples, batch_size):
            total -= float(b.logprobs(model, 1.0).sum())
            tokens += int(b.mask.sum())
    return total / max(tokens, 1)


def train_visual_sft(model: Any, train: list[Sample], held_out: list[Sample], config: SFTSchedule,
                     log: Callable[[int, dict[str, float]], None]) -> dict[str, float]:
    """Train `model`'s LoRA on `train` as `config` says (epochs or max_steps, lr, batch_size x grad_accum per
    optimizer step); `log(step, row)` gets each step's loss, learning rate and gradient norm. Returns the text
    SFT's metrics: n_train, n_eval, eval_loss_before/after (on `held_out`), train_loss (mean over steps),
    train_seconds, steps."""
    import torch

    steps = _step_indices(len(train), config)
    metrics: dict[str, float] = {"n_train": len(train), "n_eval": len(held_out)}
    if held_out:
        metrics["eval_loss_before"] = demonstration_loss(model, held_out, config.batch_size)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1 - k / len(steps))  # linear to 0, as TRL
    model.train()  # the LoRA's dropout is on, as in the text SFT
    losses, start = [], time.perf_counter()
    for step, indices in enumerate(steps, 1):
        batches = _batches(model, [train[i] for i in indices], config.batch_size)
        tokens = sum(int(b.mask.sum()) for b in batches)
        loss = 0.0
        for b in batches:  # each micro-batch's share of the token mean over the step
            part = -b.logprobs(model, 1.0).sum() / max(tokens, 1)
            part.backward()
            loss += float(part.detach())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        log(step, {"loss": loss, "learning_rate": schedule.get_last_lr()[0], "grad_norm": grad_norm})
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss)
    metrics.update(train_loss=sum(losses) / len(losses), train_seconds=time.perf_counter() - start, steps=len(steps))
    if held_out:
        metrics["eval_loss_after"] = demonstration_loss(model, held_out, config.batch_size)
    return metrics


def _step_indices(n: int, config: SFTSchedule) -> list[list[int]]:
    """The demonstrations of each optimizer step: every epoch a fresh shuffle (from `config.seed`), cut into
    steps of batch_size x grad_accum (the last of an epoch may be smaller); `max_steps` or `epochs` of them."""
    if n == 0:
        raise ValueError("no demonstrations to train on (after holding out eval_fraction)")
    per_step = config.batch_size * config.grad_accum
    per_epoch = math.ceil(n / per_step)
    total = config.max_steps or math.ceil(config.epochs * per_epoch)
    out: list[list[int]] = []
    for epoch in range(math.ceil(total / per_epoch)):
        order = list(range(n))
        random.Random(config.seed + epoch).shuffle(order)
        out += [order[i : i + per_step] for i in range(0, n, per_step)]
    return out[:total]


def _batches(model: Any, samples: list[Sample], size: int) -> list[Any]:
    """The samples' micro-batches of at most `size` (right-padded, images stacked: stages.update.train)."""
    from stages.update.train import _micro_batches

    return _micro_batches(samples, size, next(model.parameters()).device)
