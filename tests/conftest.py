"""Shared fixtures: the real SmolLM2 tokenizer and a tiny random Llama built around it.

Tests never run the 135M model; the tiny model has the real tokenizer and chat template, so
everything about tokens and templates is exercised for real while a forward pass stays cheap.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# One OpenMP/MKL thread in every process the tests start (`rlops` commands, Prefect flow runs, Ray
# workers, servers), set before any of them is: the xdist workers already fill the cores, and each
# child's torch defaulting to one thread per core oversubscribed them (torch threads that spin-wait on
# each other slow down many times over on a loaded 2-core machine). A value the caller set is kept.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
# vLLM's CPU engine (stages/policy/vllm.py) would bind its threads to every core: here it takes OMP_NUM_THREADS, unbound.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

# The suite's own model cache (what `make test` fills; the Makefile also gives pytest an empty HOME), never a
# developer's ~/.cache/rlops: a test that needs a model builds it or gets it from a fixture. Run directly,
# pytest uses the same folder, and the default model is prepared there on first use.
os.environ.setdefault("RLOPS_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "rlops"))

pytest_plugins = ["tests.netguard", "tests.xdist_groups"]  # loopback only, no server outlives the suite; groups
# Before any test module imports mlflow: storage.tracking turns MLflow's usage reports off, as it does
# for rlops itself (stages/cluster.py does the same for Ray's); the guard catches anything else.
import storage.tracking  # noqa: E402, F401


@pytest.fixture(scope="session", autouse=True)
def _few_threads() -> None:
    # The test machine's cores are shared; tiny models gain nothing from more threads.
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The prepared SmolLM2-135M-Instruct folder (a no-op once prepared); used for its tokenizer."""
    from stages.policy.model import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path) -> Any:
    """The real SmolLM2 tokenizer (chatml template, eos = pad = <|im_end|>), left padding."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    tok.padding_side = "left"
    return tok


def _tiny_llama(tokenizer: Any) -> dict[str, Any]:
    """The tiny Llama's config (hidden 32, 2 layers) over `tokenizer`'s vocabulary: the test policy, and
    the text model of the tiny VLM."""
    return dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)


# What vLLM's CPU kernels take (`vllm_model_dir`, `vllm_vlm`): attention heads 32
# wide (the tiny Llama's 8 are refused: "Unsupported CPU attention configuration: head_dim=8").
VLLM_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    """A folder with a tiny random LlamaForCausalLM (hidden 32, 2 layers, SmolLM2's vocabulary) and
    the SmolLM2 tokenizer, loadable by path like any model (e.g. `load_policy(str(path))`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**_tiny_llama(tokenizer))
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    """The tiny Llama with attention heads vLLM's CPU kernels take (VLLM_TEXT: hidden 64, 2 heads of 32, 1 KV head)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**(_tiny_llama(tokenizer) | VLLM_TEXT))
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama-vllm")
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def vllm_backend(vllm_model_dir: Path) -> Any:
    """The real vLLM engine (vllm-cpu) on `vllm_model_dir`, built once per session as a run builds it
    (`resident_vllm`: the tests that use it are one xdist group, "vllm", so one worker holds it)."""
    from stages.policy.vllm import resident_vllm

    return resident_vllm(str(vllm_model_dir))


@pytest.fixture(autouse=True)
def _isolated_tracking_uri() -> Iterator[None]:
    # mlflow.set_tracking_uri() exports MLFLOW_TRACKING_URI, which Settings honours (a remote server
    # is a settings change): without this, one test's workspace would leak into the next. Cleared
    # after each test too, not only before: a package- or module-scoped fixture set up for the next
    # test runs before this one does (found by pytest -n 2, whose order put a views fixture after
    # tests/storage/test_tracking.py: the fixture's run then tracked into that test's database).
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    yield
    os.environ.pop("MLFLOW_TRACKING_URI", None)


def _vlm_tokenizer(default_model_dir: Path, image_tokens: list[str]) -> Any:
    """The SmolLM2 tokenizer with a VLM's image tokens added as special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    tok.add_special_tokens({"additional_special_tokens": image_tokens})
    return tok


def _content_parts_template(image: str) -> str:
    """A chatml template that renders OpenAI-style content parts, each image part as `image` (the text the
    processor then expands into the image's placeholder tokens)."""
    return (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% for part in message['content'] %}{% if part['type'] == 'image' %}" + image + "{% else %}{{ part['text'] }}"
        "{% endif %}{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def _saved_vlm(path: Path, model_class: Any, config: Any, processor: Any) -> Path:
    """A random model of `config` (seeded) saved with its processor in `path`."""
    import torch

    torch.manual_seed(0)
    model_class(config).save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A folder with a tiny random Idefics3 (SmolVLM's architecture: a 1-layer vision tower, 32x32 images in
    8x8 patches, pixel shuffle to 4 image tokens, the tiny Llama text model) and its processor: the SmolLM2
    tokenizer plus Idefics3's image tokens, a chatml template that renders OpenAI content parts, and an image
    processor that resizes every image to one 32x32 tile. Loadable by path (`VLMPolicy.load`)."""
    return _tiny_idefics3(tmp_path_factory.mktemp("tiny-idefics3"), default_model_dir)


def _tiny_idefics3(path: Path, default_model_dir: Path, vllm_sized: bool = False) -> Path:
    """`tiny_vlm_dir`'s model in `path`; `vllm_sized`: with heads vLLM's CPU attention takes (VLLM_TEXT, a tower
    of width 64)."""
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil,
                              Idefics3Processor)

    tok = _vlm_tokenizer(default_model_dir, ["<fake_token_around_image>", "<image>", "<global-img>"])
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": 32},
                                       max_image_size={"longest_edge": 32})
    processor = Idefics3Processor(image_processor=images, tokenizer=tok,
                                  chat_template=_content_parts_template("<image>"), image_seq_len=4)
    text = dict(model_type="llama", **_tiny_llama(tok)) | (VLLM_TEXT if vllm_sized else {})
    width = dict(hidden_size=64, intermediate_size=64) if vllm_sized else dict(hidden_size=16, intermediate_size=32)
    config = Idefics3Config(
        vision_config=dict(**width, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8),
        text_config=text, image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2,
        tie_word_embeddings=True,
    )
    return _saved_vlm(path, Idefics3ForConditionalGeneration, config, processor)


@pytest.fixture(scope="session")
def vllm_vlm(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Callable[[str], Path]:
    """`tiny_vlm`'s models with heads vLLM's CPU kernels take (VLLM_TEXT), by architecture, each built on first use."""
    built: dict[str, Path] = {}

    def folder(architecture: str) -> Path:
        if architecture not in built:
            path = tmp_path_factory.mktemp(f"vllm-{architecture}")
            built[architecture] = (_tiny_idefics3(path, default_model_dir, vllm_sized=True) if architecture == "idefics3"
                                   else _tiny_qwen_vl(architecture, path, default_model_dir, vllm_sized=True))
        return built[architecture]

    return folder


# The tiny VLMs' architectures (`tiny_vlm`): the two layouts of image tensors, and Qwen2.5-VL's windowed tower.
VLM_ARCHITECTURES = ("idefics3", "qwen2_vl", "qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_vlm(tiny_vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory,
             default_model_dir: Path) -> Callable[[str], Path]:
    """The folder of a tiny random VLM by architecture (one of VLM_ARCHITECTURES), each built once on first use:
    "idefics3" is `tiny_vlm_dir`; "qwen2_vl" and "qwen2_5_vl" are `_tiny_qwen_vl`'s."""
    built = {"idefics3": tiny_vlm_dir}

    def folder(architecture: str) -> Path:
        if architecture not in built:
            built[architecture] = _tiny_qwen_vl(architecture, tmp_path_factory.mktemp(f"tiny-{architecture}"),
                                                default_model_dir)
        return built[architecture]

    return folder


def _tiny_qwen_vl(architecture: str, path: Path, default_model_dir: Path, vllm_sized: bool = False) -> Path:
    """A tiny random Qwen2-VL or Qwen2.5-VL and its processor in `path`: the SmolLM2 tokenizer plus Qwen's vision
    tokens, a chatml template writing each image as `<|vision_start|><|image_pad|><|vision_end|>`, an image
    processor that resizes each image to 256-576 pixels in 4x4 patches (16-36 patches, merged 2x2 into 4-9 image
    tokens), a 1-layer vision tower of width 16 and the tiny Llama's shapes for the text model, whose M-RoPE
    splits the 8-wide heads' 4 rotary frequencies 2/1/1 over time, height and width; `vllm_sized`: heads 32 wide
    (VLLM_TEXT, frequencies 8/4/4) in the text model and the tower, which vLLM's CPU attention takes."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil, Qwen2VLProcessor)

    from stages.policy.vlm import images_only

    tok = _vlm_tokenizer(default_model_dir, ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    images = Qwen2VLImageProcessorPil(min_pixels=256, max_pixels=576, patch_size=4, merge_size=2, temporal_patch_size=2)
    qwen2 = architecture == "qwen2_vl"
    # No torchvision here, which transformers 5 needs for Qwen's video processor: the processor takes images only.
    template = _content_parts_template("<|vision_start|><|image_pad|><|vision_end|>")
    processor = images_only(Qwen2VLProcessor if qwen2 else Qwen2_5_VLProcessor)(image_processor=images, tokenizer=tok,
                                                                                chat_template=template)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 4, 4] if vllm_sized else [2, 1, 1]}
    text = _tiny_llama(tok) | (VLLM_TEXT if vllm_sized else {}) | {"rope_parameters": rope}
    ids = {field: tok.convert_tokens_to_ids(token) for field, token in [
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]}
    tower = dict(depth=1, num_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    width, out = (64, text["hidden_size"]) if vllm_sized else (16, 32)
    if qwen2:
        config = Qwen2VLConfig(text_config=text, vision_config=tower | dict(embed_dim=width, mlp_ratio=2, hidden_size=out),
                               tie_word_embeddings=True, **ids)
        return _saved_vlm(path, Qwen2VLForConditionalGeneration, config, processor)
    # Qwen2.5-VL's tower attends in windows (16 px: 2x2 merged tokens) except in fullatt_block_indexes.
    vision = tower | dict(hidden_size=width, intermediate_size=2 * width, out_hidden_size=out, window_size=16,
                          fullatt_block_indexes=[0])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    return _saved_vlm(path, Qwen2_5_VLForConditionalGeneration, config, processor)
