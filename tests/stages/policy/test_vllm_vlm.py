"""The vLLM path of a vision-language policy (stages/policy/vllm_vlm.py) on CPU, without vLLM: the requests it
builds from real tiny VLM processors (Idefics3 and Qwen2-VL), the engine's image limit, the sampling
suppression, and the check that refuses a prompt vLLM expanded differently from the HF processor. The
generation itself needs vLLM and a GPU (bench/gpu_vlm_vllm.py; the last test here runs it where both exist)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from stages.policy.vllm import prompt_difference
from stages.policy.vllm_vlm import build_request, engine_kwargs
from stages.policy.vlm import VLMPolicy
from storage.images import ImageStore
from tests.stages.policy.test_vlm import IMAGE_STRUCTURE, episode, image_part, png


@pytest.fixture(scope="module", params=["idefics3", "qwen2_vl"])
def policies(request, tiny_vlm, tmp_path_factory) -> tuple[str, VLMPolicy, VLMPolicy]:
    """(architecture, the processor side without weights, the full policy) over one image store."""
    store = ImageStore(tmp_path_factory.mktemp("images"))
    folder = tiny_vlm(request.param)
    return request.param, VLMPolicy.without_weights(folder, store), VLMPolicy.load(folder, store)


def test_request_carries_unexpanded_placeholders_and_expects_the_processors_expansion(policies):
    arch, vlm, full = policies
    messages = episode((200, 0, 0), crop=True)  # two images: the prompt's and the tool's zoom
    request = build_request(vlm, messages, max_images=2)
    expected, image_ids = full.prompt(messages)  # the HF processor's expansion, as the update recomputes it
    assert request.expected_ids == expected and request.image_ids == image_ids
    tok = vlm.processor.tokenizer
    image_token = vlm.processor.image_token_id
    # vLLM expands each input placeholder itself: one per image in the request, many per image in the record.
    assert request.prompt_token_ids.count(image_token) == 2 < expected.count(image_token)
    # Outside the image structure both are the same tokens.
    structure = set(tok.convert_tokens_to_ids(IMAGE_STRUCTURE[arch]))
    assert [t for t in request.prompt_token_ids if t not in structure] == [t for t in expected if t not in structure]
    prompt = request.vllm_prompt()
    assert prompt["prompt_token_ids"] == request.prompt_token_ids
    assert [im.size for im in prompt["multi_modal_data"]["image"]] == [(40, 30), (20, 50)]  # decoded, in order
    assert all(im.mode == "RGB" for im in prompt["multi_modal_data"]["image"])


def test_text_only_request_has_no_multimodal_data(policies):
    _, vlm, _ = policies
    request = build_request(vlm, [{"role": "user", "content": "Hello"}])
    assert request.prompt_token_ids == request.expected_ids and request.images == []
    assert request.vllm_prompt() == {"prompt_token_ids": request.expected_ids}


def test_without_weights_matches_the_loaded_policy(policies):
    arch, vlm, full = policies
    assert vlm.model is None
    assert (vlm.eos_ids, vlm.banned_ids, vlm.fingerprint) == (full.eos_ids, full.banned_ids, full.fingerprint)
    # What VLLMBackend.generate gives a -inf logit bias: the image-structure tokens only the processor writes.
    assert set(vlm.banned_ids) == set(vlm.processor.tokenizer.convert_tokens_to_ids(IMAGE_STRUCTURE[arch]))


def test_too_many_images_refused_before_compute(policies):
    _, vlm, _ = policies
    with pytest.raises(ValueError, match=r"2 images in one prompt; the engine takes at most 1 \(max_images\)"):
        build_request(vlm, episode((0, 200, 0), crop=True), max_images=1)


def test_engine_image_limit():
    assert engine_kwargs() == {"limit_mm_per_prompt": {"image": 8}}
    assert engine_kwargs(3) == {"limit_mm_per_prompt": {"image": 3}}
    with pytest.raises(ValueError, match="max_images must be at least 1"):
        engine_kwargs(0)


def test_prompt_mismatch_is_an_error():
    assert prompt_difference([1, 2, 3, 3, 4], [1, 2, 3, 3, 4]) is None
    assert "of 5 tokens that differs from the recorded 5 at position 3" in prompt_difference([1, 2, 3, 9, 4], [1, 2, 3, 3, 4])
    # a placeholder expanded twice: longer
    assert "of 6 tokens that differs from the recorded 5 at position 5" in prompt_difference([1, 2, 3, 3, 4, 4], [1, 2, 3, 3, 4])


def test_image_in_user_text_part_counts(policies):
    """Images in a single user turn with text around them keep their order."""
    _, vlm, _ = policies
    messages = [{"role": "user", "content": [image_part(png((1, 2, 3), (30, 30))), {"type": "text", "text": "vs"},
                                             image_part(png((3, 2, 1), (50, 20)))]}]
    request = build_request(vlm, messages)
    assert [im.size for im in request.images] == [(30, 30), (50, 20)]
    assert len(request.image_ids) == 2 and request.image_ids[0] != request.image_ids[1]


def test_vllm_generation_matches_hf_recomputation():
    """On a GPU: bench/gpu_vlm_vllm.py's check, asserted (the small VLM's size, bf16). On the CPU the same path runs
    with a tiny Idefics3 (tests/flows/test_vllm_pipeline.py), and the bench at this size takes ~100 s on 2 cores:
    its fp32 numbers are in docs/BENCHMARKS.md ("vLLM on CPU")."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("the small VLM's size on vLLM: run on a GPU (the CPU path is tested with a tiny Idefics3)")
    spec = importlib.util.spec_from_file_location("gpu_vlm_vllm", Path(__file__).parents[3] / "bench" / "gpu_vlm_vllm.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    found = check.main()  # raises on a prompt vLLM expanded differently from the HF processor
    for policy_id, (mean, _, _, tokens) in found.items():
        assert tokens > 0 and mean < 1e-2, (policy_id, found)
