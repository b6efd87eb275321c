"""Load a policy: a base model plus an optional LoRA adapter, and its tokenizer.

torch, transformers and peft are imported inside the function, so importing this module is cheap.
"""

from __future__ import annotations

from typing import Any

from stages.policy.model import MODEL_LOADING, resolve_model


def load_policy(
    base_model: str,
    adapter_dir: str | None = None,
    trainable: bool = False,
    device: str | None = None,
    dtype: str | None = None,
) -> tuple[Any, Any]:
    """Load (model, tokenizer) for generation or training.

    `base_model` goes through `resolve_model` (the default name, a local folder, or a hub id).
    `adapter_dir` is a peft LoRA adapter folder (safetensors) loaded on top of the base; with
    `trainable` its weights require grad and the model is in train mode, otherwise eval mode.
    `device` defaults to cuda when available, else cpu; `dtype` ("float32", "bfloat16", ...)
    defaults to bf16 on cuda and fp32 on cpu (bf16 matmuls are slower than fp32 on CPUs without
    AMX, DESIGN.md). The tokenizer pads on the left (batched generation needs the prompts to end
    at the same column) and always has a pad token (EOS when the model defines none).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(base_model)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = getattr(torch, dtype) if dtype else (torch.bfloat16 if device == "cuda" else torch.float32)

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    with MODEL_LOADING:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if adapter_dir is not None:
        from peft import PeftModel

        with MODEL_LOADING:
            model = PeftModel.from_pretrained(model, adapter_dir, is_trainable=trainable)
    model.train(trainable)
    return model, tokenizer
