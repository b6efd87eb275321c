"""vLLM generation for a vision-language policy (GPU): image inputs, LoRA on the language model, token-exact records.

    gen = VLLMVisionBackend(base_model, ImageStore(ws.settings.images_dir), max_images=8)
    gen.use_adapter(policy_id, adapter_dir)               # as VLLMBackend: a LoRARequest per policy id
    samples = gen.generate(messages, n=8, sampling=s)     # VisualSample each, as VLMPolicy.generate records them

How vLLM reads a token prompt that comes with images (vLLM's docs, design/mm_processing.md, "Tokenized Prompt
Inputs", and `BaseMultiModalProcessor._apply_hf_processor_main`): for `prompt_token_ids` it runs the HF processor
on the images only (with dummy text) and applies the prompt updates itself, i.e. it expands each *input*
placeholder (Idefics3's `<image>`, Qwen2-VL's `<|image_pad|>`) into that image's feature placeholders. So the
request carries the chat template's tokens with one input placeholder per image (`build_request`), not
`VLMPolicy.prompt`'s expanded ids, which vLLM would expand a second time. The ids vLLM ran
(`RequestOutput.prompt_token_ids`) must equal the HF processor's expansion (`check_prompt`): the update recomputes
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

vllm is imported inside the functions: the request building and the checks are plain functions, tested on CPU.
Unverified: never run against vLLM (no GPU here); `bench/gpu_vlm_vllm.py` is the check to run on one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.policy.sampling import SamplingConfig
from stages.policy.vlm import VisualSample, VLMPolicy
from stages.policy.vlm_resident import DEFAULT_MAX_IMAGES
from storage.images import ImageStore


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


def check_prompt(ran: list[int], expected: list[int]) -> None:
    """ValueError unless vLLM ran exactly the HF processor's prompt ids (the first difference named)."""
    if list(ran) == list(expected):
        return
    at = next((i for i, (a, b) in enumerate(zip(ran, expected)) if a != b), min(len(ran), len(expected)))
    raise ValueError(f"vLLM's prompt ({len(ran)} tokens) differs from the HF processor's ({len(expected)}) at "
                     f"position {at}: {list(ran[at:at + 4])} vs {list(expected[at:at + 4])}; the update could not "
                     "recompute this episode's log-probs from its tokens and pixels")


def suppressed(banned_ids: tuple[int, ...]) -> dict[int, float]:
    """SamplingParams' `logit_bias` that keeps the image-structure ids from being sampled."""
    return {i: float("-inf") for i in banned_ids}


class VLLMVisionBackend:
    """vLLM on a GPU for a VLM base model: the processor side (`VLMPolicy.without_weights`) builds the requests and
    the records; the engine holds the weights and hot-loads LoRA adapters per policy id."""

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
        from vllm import SamplingParams

        if sampling.top_p < 1.0:
            raise ValueError("VLLMVisionBackend records log-probs of the untruncated distribution only: use top_p=1.0")
        request = build_request(self.vlm, messages, self.max_images)
        base = sampling.seed if seed is None else seed
        params = [SamplingParams(temperature=sampling.temperature, top_p=1.0, max_tokens=sampling.max_new_tokens,
                                 seed=base + i, logprobs=0, logit_bias=suppressed(self.vlm.banned_ids) or None)
                  for i in range(n)]
        outputs = self.engine.llm.generate([request.vllm_prompt()] * n, params,
                                           lora_request=self.engine.lora_request, use_tqdm=False)
        samples = []
        for out in outputs:
            check_prompt(out.prompt_token_ids, request.expected_ids)
            c = out.outputs[0]
            ids = list(c.token_ids)
            lps = [step[t].logprob for step, t in zip(c.logprobs, ids)]  # one {token: Logprob} per step
            samples.append(self.vlm.record(request.expected_ids, request.image_ids, ids, lps))
        return samples
