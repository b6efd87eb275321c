"""DPO on stored rollouts through TRL's `DPOTrainer`, token-exact: `DPOConfig` and `train_dpo`.

    model = load_trainable(base_model, adapter_dir, config.lora)
    history = train_dpo(model, tokenizer, pairs, config)   # TRL trains the "default" adapter in place

What TRL does and what rlops adds (TRL 1.16):
- TRL computes the loss (`loss_type`, sigmoid = the DPO paper's), the reference log-probs and the training loop.
  Given a PeftModel that already holds an adapter, it copies that adapter as a frozen "ref" adapter and scores
  the reference with it: the reference is the starting policy (e.g. the SFT checkpoint), not the bare base.
- TRL's dataset preparation only takes text (it re-tokenizes through the chat template, and its prompt
  extraction needs a `prompt` column), and its collator marks the whole completion as trained. Neither fits
  multi-turn rollouts, whose tool results sit inside the completion and are not policy actions. So rlops
  passes the rollouts' own tokens (`_TokenDPOTrainer` skips the re-tokenizing preparation) and applies their
  loss masks (`MaskedPreferenceCollator`): TRL builds labels from `completion_mask`, so a tool token has
  label -100 and its log-prob is 0 in both the policy's and the reference's sums.
- A vision-language policy's pairs carry pixel inputs: the collator adds each sequence's image tensors, rebuilt
  from the workspace's image store as GRPO rebuilds them (`stages.update.data.pixel_inputs`), and TRL passes
  them to both forward passes (its fused LM head runs the multimodal body). Image placeholder tokens are prompt
  tokens (mask 0), so they are never in the loss. Unlike GRPO's scoring, no token is suppressed here: DPO
  compares the policy with its reference under the same full distribution, with no behaviour log-probs.

torch, transformers, trl and peft are imported inside functions: importing this module is cheap.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.common import Operational
from stages.policy.lora import LoRASettings
from stages.update.pairs import Pairing, PreferencePair


class DPOConfig(BaseModel):
    """One DPO update on the preference pairs of some scored batches. Changing any field but the
    `Operational` ones changes the output checkpoint's id."""

    model_config = ConfigDict(extra="forbid")

    pairing: Pairing = "best_worst"  # one pair per group: the clearest preference, as many pairs as groups
    min_margin: float = Field(0.0, ge=0)  # pairs whose rewards differ less are dropped (ties always are)
    beta: float = 0.1  # the DPO paper's and TRL's default strength of the implicit KL to the reference
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust"] = "sigmoid"  # sigmoid = DPO (arXiv 2305.18290)
    lr: float = 5e-5  # LoRA on a 135M model: 1e-6 (TRL's full-model default) barely moves an adapter
    epochs: int = Field(1, ge=1)  # passes over the pairs; 1 = each pair seen once, like one GRPO step
    pairs_per_step: int = Field(8, ge=1)  # pairs per optimizer step (TRL: batch size x accumulation)
    micro_batch_size: int = Field(4, ge=1)  # pairs per forward/backward; must divide pairs_per_step
    max_grad_norm: float = 1.0  # the common clip, as GRPO's
    seed: int = 0  # TRL's shuffle of the pairs
    activation_checkpointing: bool = Operational(False)  # memory for compute; the same numbers
    lora: LoRASettings = Field(default_factory=LoRASettings)  # used only when the parent has no adapter

    @model_validator(mode="after")
    def _divides(self) -> DPOConfig:
        if self.pairs_per_step % self.micro_batch_size:
            raise ValueError(f"micro_batch_size ({self.micro_batch_size}) must divide pairs_per_step "
                             f"({self.pairs_per_step})")
        return self


class MaskedPreferenceCollator:
    """TRL's `DataCollatorForPreference` (padding, chosen rows then rejected rows), with `completion_mask`
    taken from the rollouts' loss masks instead of "every completion token". `vision` (a vision-language
    policy's pairs): each rollout's pixel inputs by rollout id (`stages.policy.vlm.VisionInputs`), stacked in
    the rows' order, so TRL's forward passes (the policy's and the reference's) see each sequence's images."""

    def __init__(self, pad_token_id: int, vision: Mapping[str, Any] | None = None):
        from trl.trainer.dpo_trainer import DataCollatorForPreference

        self.inner = DataCollatorForPreference(pad_token_id=pad_token_id)
        self.vision = vision

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        out = self.inner([{k: e[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for e in examples])
        rows = ([[0] * len(e["prompt_ids"]) + list(e["chosen_mask"]) for e in examples]
                + [[0] * len(e["prompt_ids"]) + list(e["rejected_mask"]) for e in examples])
        mask = torch.zeros_like(out["completion_mask"])  # (2B, T), right-padded as TRL pads
        for i, row in enumerate(rows):
            mask[i, : len(row)] = torch.tensor(row, dtype=mask.dtype)
        out["completion_mask"] = mask
        if self.vision is not None:
            from stages.policy.vlm import VisionInputs

            ids = [e["chosen_id"] for e in examples] + [e["rejected_id"] for e in examples]
            out |= VisionInputs.stack([self.vision[i] for i in ids]).tensors  # (2B, n_images, ...)
        return out


def _trainer_class() -> type:
    from trl import DPOTrainer

    class _TokenDPOTrainer(DPOTrainer):
        """DPOTrainer over pairs that are already tokens (the rollouts' own): no re-tokenizing."""

        def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, dataset_name: str) -> Any:
            return dataset

    return _TokenDPOTrainer


def trainer_for(model: Any, tokenizer: Any, pairs: list[PreferencePair], config: DPOConfig, output_dir: str,
                vision: Mapping[str, Any] | None = None) -> Any:
    """The TRL trainer of one DPO update (built, not run): tests read its loss; `train_dpo` runs it. `vision`: as
    `MaskedPreferenceCollator` takes it."""
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import DPOConfig as TRLDPOConfig

    cuda = torch.cuda.is_available()
    args = TRLDPOConfig(
        output_dir=output_dir, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        learning_rate=config.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        num_train_epochs=config.epochs, per_device_train_batch_size=config.micro_batch_size,
        gradient_accumulation_steps=config.pairs_per_step // config.micro_batch_size,
        max_grad_norm=config.max_grad_norm, beta=config.beta, loss_type=[config.loss_type],
        seed=config.seed, data_seed=config.seed, max_length=None, remove_unused_columns=False,
        activation_checkpointing=config.activation_checkpointing, use_cpu=not cuda, bf16=cuda,
        dataloader_num_workers=0, disable_dropout=True, precompute_ref_log_probs=False,
    )
    trainer = _trainer_class()(model=model, args=args, processing_class=tokenizer,
                               train_dataset=Dataset.from_list([p.as_example() for p in pairs]),
                               data_collator=MaskedPreferenceCollator(tokenizer.pad_token_id, vision))
    # disable_tqdm makes the Trainer print every log dict to stdout, where `rlops stage` prints the id
    # (the stage logs the same rows to MLflow)
    trainer.remove_callback(PrinterCallback)
    return trainer


def train_dpo(model: Any, tokenizer: Any, pairs: list[PreferencePair], config: DPOConfig,
              vision: Mapping[str, Any] | None = None) -> list[dict[str, float]]:
    """Train `model`'s "default" adapter on `pairs` with TRL (the reference: a frozen copy of the adapter it
    starts from); returns TRL's log rows (loss, rewards/accuracies, rewards/margins, ...), one per step.
    The "ref" adapter TRL added is removed again, so `model` saves as before. `vision`: each paired rollout's
    pixel inputs, for a vision-language model (`MaskedPreferenceCollator`)."""
    with tempfile.TemporaryDirectory(prefix="rlops-dpo-") as out:
        trainer = trainer_for(model, tokenizer, pairs, config, out, vision)
        trainer.train()
        history = [{k: float(v) for k, v in row.items() if isinstance(v, (int, float))}
                   for row in trainer.state.log_history if "loss" in row]
    if "ref" in getattr(model, "peft_config", {}):
        model.delete_adapter("ref")
    model.set_adapter("default")
    return history


def pair_tokens(pairs: list[PreferencePair]) -> int:
    """Tokens trained on per pass (sampled tokens of both sides): the update budget a comparison equalises."""
    return sum(sum(p.chosen_mask) + sum(p.rejected_mask) for p in pairs)
