"""The LoRA adapter settings shared by SFT and GRPO, and a fresh adapter from them.

peft is imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from stages.common import Added

LORA_SEED = 0  # a fresh adapter's initial weights depend only on this: same inputs, same checkpoint


class LoRASettings(BaseModel):
    """A LoRA adapter's shape. GRPO uses it only when the parent policy is a bare base model (an SFT
    or GRPO parent brings its own adapter)."""

    model_config = ConfigDict(extra="forbid")

    r: int = 16  # what the reference TRL LoRA runs on SmolLM2 use; ample for one task's behaviour
    alpha: int = 32  # alpha = 2r, the usual scaling (update scale alpha/r = 2)
    # GRPO's default: dropout makes the on-policy first-pass ratio differ from 1. SFT sets 0.05
    # (light regularisation on small demonstration sets).
    dropout: float = 0.0
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj"]  # attention only: small, the usual choice
    # A vision-language model only: also a LoRA (same r and alpha) on the linear layers of the projector that maps
    # image features into the language model (Idefics3's `connector`), never on the vision tower. Off by default,
    # as in verl's and TRL's VLM LoRA: the projector is small and pretrained with the tower it reads.
    projector: bool = Added(False)

    def peft_config(self) -> Any:
        """The peft `LoraConfig` for a causal LM (ValueError with `projector`: a text model has none)."""
        from peft import LoraConfig

        if self.projector:
            raise ValueError("lora.projector needs a vision-language base model: a text model has no projector")

        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=list(self.target_modules), task_type="CAUSAL_LM")


def add_lora(model: Any, lora: LoRASettings, seed: int = LORA_SEED) -> Any:
    """Wrap a transformers model in a fresh trainable LoRA adapter, initialised from `seed`
    (without touching the global RNG)."""
    import torch
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, lora.peft_config())
