"""Export a policy for the servers people deploy with (`rlops export POLICY --format FORMAT OUT`).

    row = find_checkpoint(snapshot, "nightly@champion", registry)    # stages/policy_ref.py
    problems = export_problems(row, "gguf", Path("nightly.gguf"), "f32")   # before any work
    export(row, "gguf", Path("nightly.gguf"), "f32")

Formats:
  hf       the LoRA merged into the base weights (peft's merge_and_unload): a plain transformers folder (config,
           safetensors, tokenizer with its chat template; a vision-language model's processor), loadable by
           transformers and vLLM with no rlops import
  gguf     the same model as one GGUF file (f32 or f16) with its tokenizer and chat template, for llama.cpp and
           Ollama, and transformers' GGUF loader (stages/policy/to_gguf.py; llama architecture)
  adapter  the peft adapter alone (adapter_config.json, adapter_model.safetensors), as vLLM's --lora-modules
           takes it next to the base model

Each output also holds `rlops_export.json` (in a folder) saying what was exported: the policy, its base model
and the format. Outputs appear whole or not at all (storage/atomic.py), and never replace an existing path.
torch, transformers and peft are imported inside the functions.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from stages.policy.to_gguf import DTYPES as GGUF_DTYPES
from stages.policy.to_gguf import gguf_problems, write_gguf
from storage.atomic import atomic_dir

FORMATS = ("hf", "gguf", "adapter")
TORCH_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what vLLM's LoRA loader reads
MANIFEST = "rlops_export.json"


def base_folder(base_model: str) -> Path | None:
    """The local folder holding a base model's weights (the prepared default model, a folder, or a hub id in the
    Hugging Face cache), or None when it is not on this machine. Never downloads or prepares anything."""
    from stages.policy.model import DEFAULT_MODEL, DONE_MARKER, default_model_dir

    if base_model in (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}"):
        return default_model_dir() if (default_model_dir() / DONE_MARKER).exists() else None
    folder = Path(base_model).expanduser()
    if (folder / "config.json").is_file():
        return folder
    if base_model.startswith(("/", ".", "~")):
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(base_model, "config.json")
    except ValueError:  # not a hub id either
        return None
    return Path(cached).parent if isinstance(cached, str) else None


def export_problems(row: dict[str, Any], fmt: str, out: Path, dtype: str) -> list[str]:
    """Everything that would stop `export` of the checkpoint `row` (its catalog row), each as one line."""
    from stages.policy.vlm import is_vision_language

    problems, pid = [], row["policy_id"]
    folder = base_folder(row["base_model"])
    if folder is None:
        problems.append(f"the base model {row['base_model']!r} of {pid} is not available on this machine: export "
                        "merges into its weights (a local folder, or the default model after `rlops model prepare`)")
    adapter = row["adapter_uri"]
    if adapter is None and fmt == "adapter":
        problems.append(f"{pid} is a base model: it has no adapter to export")
    elif adapter is not None and "://" not in adapter and not Path(adapter).is_dir():
        problems.append(f"the adapter files of {pid} are missing: {adapter}")
    if out.exists() and (out.is_file() or any(out.iterdir())):
        problems.append(f"{out} exists: export writes a new file or folder, never over one")
    if fmt == "adapter" and dtype != "f32":
        problems.append("--dtype: an adapter is exported as it was trained (f32)")
    if fmt == "gguf" and dtype not in GGUF_DTYPES:
        problems.append(f"--dtype: gguf export writes {' or '.join(GGUF_DTYPES)}, not {dtype}")
    if fmt == "gguf" and folder is not None:
        if is_vision_language(json.loads((folder / "config.json").read_text())):
            problems.append(f"{row['base_model']} is a vision-language model: gguf export writes text models "
                            "(use --format hf)")
        else:
            problems.extend(gguf_problems(folder))
    return problems


def export(row: dict[str, Any], fmt: str, out: Path, dtype: str = "f32") -> Path:
    """Write the checkpoint `row` in `fmt` to `out` (see the module docstring); call `export_problems` first."""
    from storage.checkpoints import local_copy

    folder = base_folder(row["base_model"])
    assert folder is not None, "export_problems reports a missing base model"
    adapter = local_copy(row["adapter_uri"])  # a local folder (downloaded once from an object-store data root)
    manifest = {"policy_id": row["policy_id"], "base_model": row["base_model"], "format": fmt, "dtype": dtype,
                "run_name": row.get("run_name"), **({"registered": _registered(row)} if "registered" in row else {})}
    if fmt == "adapter":
        with atomic_dir(out) as tmp:
            for name in ADAPTER_FILES:
                shutil.copy2(Path(adapter) / name, tmp / name)
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        return out
    model, processor = merged(folder, adapter, dtype)
    if fmt == "gguf":
        write_gguf(model, folder, out, dtype, name=row["policy_id"])
        return out
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        processor.save_pretrained(tmp)  # the tokenizer with its chat template (a VLM: the processor)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return out


def merged(folder: Path, adapter: str | None, dtype: str = "f32") -> tuple[Any, Any]:
    """(the base model with the adapter merged into its weights, its tokenizer or processor), on the CPU. The
    merge runs in fp32 whatever `dtype`, then the weights are cast, so f16 rounds once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from stages.policy.vlm import is_vision_language, load_processor

    visual = is_vision_language(AutoConfig.from_pretrained(folder))
    auto = AutoModelForImageTextToText if visual else AutoModelForCausalLM
    model = auto.from_pretrained(folder, dtype=torch.float32)
    processor = load_processor(folder) if visual else AutoTokenizer.from_pretrained(folder)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.to(getattr(torch, TORCH_DTYPES[dtype])).eval(), processor


def _registered(row: dict[str, Any]) -> dict[str, str]:
    version = row["registered"]
    return {"model": version.name, "version": version.version}

