"""The LoRA adapter settings shared by SFT and GRPO, and a fresh adapter from them (for a text model, and for a
vision-language model: on its language model, optionally its projector, never its vision tower).

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


def add_vlm_lora(model: Any, lora: LoRASettings, seed: int | None = None) -> Any:
    """`add_lora` for a vision-language model: the adapter goes on the language model's
    `lora.target_modules` only; the vision tower (whose attention reuses names like q_proj: Idefics3's
    `vision_model`, Qwen2-VL's `visual`, which also holds its merger, the projector) stays frozen, as in verl's
    and TRL's default VLM LoRA. `lora.projector`: the projector's linear layers get one too
    (`projector_layers`; ValueError when the model has none)."""
    import re

    import torch
    from peft import LoraConfig, get_peft_model

    names = "|".join(lora.target_modules)
    target = rf"^(?!.*(vision|visual)).*\.({names})$"  # peft full-matches a string
    if lora.projector:
        layers = projector_layers(model)
        if not layers:
            raise ValueError(f"lora.projector: found no projector in {type(model).__name__} "
                             f"(looked for linear layers under {', '.join(_PROJECTOR_NAMES)})")
        target += "|" + "|".join(re.escape(n) for n in layers)
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, task_type="CAUSAL_LM",
                        target_modules=target)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(LORA_SEED if seed is None else seed)
        return get_peft_model(model, config)


# The module that maps image features into the language model's embeddings: Idefics3/SmolVLM's `connector`,
# LLaVA-style `multi_modal_projector`, Qwen2-VL's `merger` (which sits inside its vision module).
_PROJECTOR_NAMES = ("connector", "multi_modal_projector", "merger")


def projector_layers(model: Any) -> list[str]:
    """The names of the linear layers of a vision-language model's projector (`_PROJECTOR_NAMES`)."""
    import torch

    return [n for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and any(part in _PROJECTOR_NAMES for part in n.split("."))]
