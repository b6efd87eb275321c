"""SFT warm-start: base model + chat demonstrations -> a LoRA checkpoint (TRL's SFTTrainer + peft).

    ref = run(SFTConfig(), ctx, base_model="SmolLM2-135M-Instruct", data="data/sft.jsonl")

The data is JSONL or Parquet with a `messages` column in OpenAI chat shape (an optional `tools`
column is ignored: our tasks teach tools in the system prompt and write calls as
`<tool_call>{...}</tool_call>` text, which is what the model must learn to emit). For a vision-language
base model, user, system and tool contents may hold `image_url` parts with base64 data URLs: that model
trains with pixel inputs in the project's own loop (stages/update/visual_sft.py, which says why not TRL's).
The loss covers assistant tokens only, including each assistant turn's end-of-turn token so the model
learns to stop.
The artifact id covers the base model, the data file's content hash and the config, so editing the
data retrains and rerunning with the same inputs is a cache hit.

torch, transformers, peft and trl are imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import hashlib
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field

from stages.checkpoints import Checkpoint, write_checkpoint
from stages.common import ArtifactRef, StageContext, base_policy, identity, run_stage
from stages.policy.lora import LoRASettings
from stages.policy.model import resolve_model
from stages.policy.vlm import is_vision_language_model, text_content
from storage.ids import config_hash

VERSION = "1"  # bump when training changes for the same config (template, masking, saving)

# ChatML with `{% generation %}` around what the assistant produces: its content and its <|im_end|>
# (the stop token), but not the `<|im_start|>assistant\n` header (the prompt supplies that at inference)
# nor the newline after <|im_end|> (generation stops before it). Renders byte-identically to SmolLM2's template.
CHATML_TRAINING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class SFTConfig(BaseModel):
    """How to fine-tune. Defaults suit a ~100M-1B model on a few hundred short agent demonstrations."""

    model_config = ConfigDict(extra="forbid")

    epochs: float = 3.0  # a few passes teach a fixed tool-call format without memorising the answers
    max_steps: int | None = None  # when set, overrides epochs (tests and quick smoke runs)
    lr: float = 2e-4  # the usual LoRA rate: ~10x full fine-tuning, since only the adapter moves
    batch_size: int = 4  # per device; small batches keep CPU memory low with a 49k vocabulary
    grad_accum: int = 1  # raise it for a larger effective batch without more memory
    max_length: int = 1024  # tokens; a doc_search episode is ~500, longer ones are cut at the end
    # r 16 on the attention projections: enough for a format and a habit, not for new knowledge; light
    # dropout against overfitting small data sets (GRPO turns it off when it continues this adapter).
    lora: LoRASettings = Field(default_factory=lambda: LoRASettings(dropout=0.05))
    eval_fraction: float = 0.1  # held-out share of the data for eval loss before/after (0: none)
    seed: int = 0  # data split, adapter init and shuffling


def file_hash(path: str | Path) -> str:
    """sha256 of a file's bytes (16 hex digits): the data's identity in the artifact id."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def load_conversations(path: str | Path) -> list[list[dict[str, Any]]]:
    """The `messages` of each row of a JSONL or Parquet file, reduced to {role, content} (a string, or a list
    of OpenAI content parts as given).

    An assistant message with empty content and OpenAI `tool_calls` gets the calls written as
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` text, the format the tasks parse.
    """
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path, columns=["messages"]).to_pylist()
    else:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [[{"role": m["role"], "content": _content(m)} for m in row["messages"]] for row in rows]


def _content(message: dict[str, Any]) -> str:
    if message.get("content") or not message.get("tool_calls"):
        return message.get("content") or ""
    calls = []
    for call in message["tool_calls"]:
        fn = call.get("function") or call  # OpenAI {"function": {name, arguments}} or rollouts' {id, name, arguments}
        arguments = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
        calls.append(f"<tool_call>{json.dumps({'name': fn['name'], 'arguments': arguments})}</tool_call>")
    return "".join(calls)


def training_template(tokenizer: Any) -> str:
    """A chat template with `{% generation %}` markers for assistant-only loss: the tokenizer's own if it
    has them, else the ChatML one when it renders exactly like the tokenizer's, else TRL's patched
    version for templates TRL knows (it raises for the rest)."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    if has_generation_markers(tokenizer.chat_template):
        return tokenizer.chat_template
    probe = [{"role": role, "content": role[0]} for role in ("system", "user", "assistant", "tool", "assistant")]
    ours = tokenizer.apply_chat_template(probe, tokenize=False, chat_template=CHATML_TRAINING_TEMPLATE)
    if ours == tokenizer.apply_chat_template(probe, tokenize=False):
        return CHATML_TRAINING_TEMPLATE
    return get_training_chat_template(tokenizer)


def build_trainer(config: SFTConfig, model_path: str, train: list[list[dict[str, str]]],
                  held_out: list[list[dict[str, str]]], output_dir: str, callbacks: list[Any] = ()) -> Any:
    """A TRL `SFTTrainer` with a fresh LoRA adapter on `model_path`, its tokenizer set to the training
    template and its datasets tokenized with assistant-only labels (-100 elsewhere)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import SFTConfig as TRLSFTConfig
    from trl import SFTTrainer

    from stages.policy.logprobs import token_logprobs

    class AssistantLossTrainer(SFTTrainer):
        # TRL's fused LM head scores every position on devices without Triton (all of them on CPU, with
        # entropy and accuracy on top); score only the assistant tokens, in chunks (stages/policy/logprobs.py).
        def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            mask = inputs["labels"] != -100  # (B, T): assistant tokens, TRL's labels are not shifted
            logprobs = token_logprobs(model, inputs["input_ids"], inputs["attention_mask"], positions_mask=mask)
            n = num_items_in_batch if num_items_in_batch is not None else mask.sum().clamp(min=1)
            return -logprobs.sum() / n  # token mean over the whole (accumulated) batch, like TRL's "nll"

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.chat_template = training_template(tokenizer)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    cuda = torch.cuda.is_available()
    args = TRLSFTConfig(
        output_dir=output_dir,
        num_train_epochs=config.epochs,
        max_steps=config.max_steps or -1,
        learning_rate=config.lr,
        per_device_train_batch_size=config.batch_size,
        per_device_eval_batch_size=config.batch_size,
        gradient_accumulation_steps=config.grad_accum,
        max_length=config.max_length,
        assistant_only_loss=True,
        seed=config.seed,
        bf16=cuda,  # mixed bf16 on GPUs; fp32 on CPU, where bf16 matmuls are slower (no AMX)
        activation_checkpointing=False,  # TRL turns it on by default; small models don't need the recompute
        logging_steps=1,
        prediction_loss_only=True,  # eval needs only the loss; our compute_loss builds no logits
        save_strategy="no",  # we save the adapter ourselves, atomically
        report_to="none",  # metrics go to our own MLflow run (callbacks)
        disable_tqdm=True,
        dataloader_pin_memory=cuda,  # pinning only helps host-to-GPU copies (and warns without a GPU)
    )
    trainer = AssistantLossTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list([{"messages": m} for m in train]),
        eval_dataset=Dataset.from_list([{"messages": m} for m in held_out]) if held_out else None,
        processing_class=tokenizer,
        peft_config=config.lora.peft_config(),
        callbacks=list(callbacks),
    )
    # disable_tqdm makes the Trainer print every log dict to stdout; our LogToTracker callback sends them
    # to MLflow instead, so the console keeps stage progress only.
    trainer.remove_callback(PrinterCallback)
    return trainer


def run(config: SFTConfig, ctx: StageContext, base_model: str, data: str) -> ArtifactRef:
    """Fine-tune a LoRA adapter on `base_model` from the chat data at `data`; register it as a checkpoint
    (kind "sft", parent: the base policy) whose id is the returned artifact id. Cached per
    (base model, data content, config)."""
    ws = ctx.ws
    visual = is_vision_language_model(base_model)
    parent_id = base_policy(ws, base_model)
    data_path = str(Path(data).resolve())
    data_hash = file_hash(data_path)

    def body(policy_id: str, run_id: str) -> dict[str, float]:
        conversations = load_conversations(data_path)
        random.Random(config.seed).shuffle(conversations)
        n = len(conversations)
        n_eval = max(1, round(n * config.eval_fraction)) if config.eval_fraction > 0 and n > 1 else 0
        held_out, train = conversations[:n_eval], conversations[n_eval:]
        model_path = resolve_model(base_model)
        log = lambda step, row: ws.tracker.log_metrics(run_id, row, step=step)  # noqa: E731
        trainer = _train_visual if visual else _train_text
        metrics, save = trainer(config, ctx, model_path, train, held_out, log)
        write_checkpoint(ctx, Checkpoint(policy_id, parent_id=parent_id, base_model=base_model, kind="sft", step=0,
                                         config_hash=config_hash(identity(config)), mlflow_run_id=run_id,
                                         trained_on={"data": data_path, "data_hash": data_hash}), save=save)
        return metrics

    return run_stage(ctx, "sft", "checkpoint", inputs=[parent_id, f"data:{data_hash}"], config=config, body=body,
                     version=VERSION)


def _train_text(config: SFTConfig, ctx: StageContext, model_path: str, train: list[list[dict[str, Any]]],
                held_out: list[list[dict[str, Any]]], log: Callable[[int, dict[str, Any]], None]
                ) -> tuple[dict[str, float], Callable[[Path], None]]:
    """SFT of a text base model with TRL (`build_trainer`); returns the metrics and the checkpoint's writer.
    Content parts are joined to their text; an image part is a ValueError naming the model, before training."""
    from transformers import AutoTokenizer, TrainerCallback

    class LogToTracker(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any) -> None:
            log(state.global_step, logs or {})

    train, held_out = ([[{**m, "content": text_content(m["content"], model_path)} for m in c] for c in part]
                       for part in (train, held_out))
    with tempfile.TemporaryDirectory() as trainer_dir:
        trainer = build_trainer(config, model_path, train, held_out, trainer_dir, [LogToTracker()])
        metrics: dict[str, float] = {"n_train": len(train), "n_eval": len(held_out)}
        if held_out:  # a fresh LoRA adapter is a no-op (B = 0), so this is the base model's loss
            metrics["eval_loss_before"] = trainer.evaluate()["eval_loss"]
        start = time.perf_counter()
        metrics["train_loss"] = trainer.train().training_loss
        metrics["train_seconds"] = time.perf_counter() - start
        metrics["steps"] = trainer.state.global_step
        if held_out:
            metrics["eval_loss_after"] = trainer.evaluate()["eval_loss"]

    def save(folder: Path) -> None:
        trainer.model.save_pretrained(folder, safe_serialization=True)
        # The base model's own tokenizer, not the trainer's: the training template only adds mask markers.
        AutoTokenizer.from_pretrained(model_path).save_pretrained(folder)

    return metrics, save


def _train_visual(config: SFTConfig, ctx: StageContext, model_path: str, train: list[list[dict[str, Any]]],
                  held_out: list[list[dict[str, Any]]], log: Callable[[int, dict[str, Any]], None]
                  ) -> tuple[dict[str, float], Callable[[Path], None]]:
    """SFT of a vision-language base model (stages/update/visual_sft.py: why not TRL's SFTTrainer): a fresh
    `config.lora` on its language model (and projector, `lora.projector`), every demonstration tokenised and its
    images stored and checked before training; returns the metrics and the checkpoint's writer."""
    from stages.policy.lora import add_vlm_lora
    from stages.policy.vlm import VLMPolicy
    from stages.update.visual_sft import demonstration_sample, train_visual_sft
    from storage.images import ImageStore

    base = VLMPolicy.load(model_path, ImageStore(ctx.ws.settings.images_dir))
    policy = VLMPolicy(add_vlm_lora(base.model, config.lora, seed=config.seed), base.processor, base.store)
    samples = [[demonstration_sample(policy, c, config.max_length) for c in part] for part in (train, held_out)]
    metrics = train_visual_sft(policy.model, samples[0], samples[1], config, log)

    def save(folder: Path) -> None:
        policy.model.save_pretrained(folder, safe_serialization=True)
        policy.processor.save_pretrained(folder)  # as the text SFT saves its tokenizer: the base's, unchanged

    return metrics, save
