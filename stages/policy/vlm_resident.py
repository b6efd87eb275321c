"""A vision-language model as a resident policy: what the policy service serves when its base model sees images.

    policy = load_resident(base_model, engine="hf", store=ImageStore(settings.images_dir))
    policy.generate("base", None, [prompt_ids] * 4, sampling, seed=7, images=image_ids)  # one request's prompts

`VisualResidentPolicy` is a `ResidentPolicy` (LoRA adapters hot-loaded by folder, generation serialised)
over a `stages.policy.vlm.VLMPolicy`: the HF backend's batched sampler (top_p, stop strings, constraints,
streaming, top log-probs, the behaviour log-prob recorder) runs the VLM's `generate` with the pixel inputs of
the prompts' images, rebuilt from the image store by `VLMPolicy.vision_inputs` exactly as training rebuilds
them, and the image-structure tokens suppressed (`VLMPolicy.banned_ids`, before the recorder), so the recorded
log-probs are what `VLMPolicy.logprobs` recomputes from the stored image ids. `chat` is its conversation format
(stages/policy/vlm_chat.py): prompts come from it with each image expanded into its placeholder tokens.

One call's prompts share their images (one request: its n samples); the policy service generates a request
with images alone for that reason (stages/service/service.py). The vLLM engine's multimodal path is not wired:
`load_resident` refuses a VLM on it.
"""

from __future__ import annotations

from typing import Any, Callable

from stages.policy.hf import HFBackend
from stages.policy.resident import Engine, ResidentPolicy
from stages.policy.sampling import RowOptions, Sample, SamplingConfig
from stages.policy.vlm import VLMPolicy, is_vision_language
from stages.policy.vlm_chat import VisualChatFormat
from storage.images import ImageStore

# Images per request the service takes by default: the tiny test VLM and SmolVLM see each image as tens to
# hundreds of tokens; a screenshot agent's episode with a few views per turn stays well under this.
DEFAULT_MAX_IMAGES = 8


class VisualResidentPolicy(ResidentPolicy):
    """A resident vision-language policy (module docstring)."""

    def __init__(self, vlm: VLMPolicy, max_adapters: int = 8) -> None:
        tokenizer = vlm.processor.tokenizer
        # No shared prefill (it runs the model on tokens alone) and no kept cache (the service keeps none).
        super().__init__(HFBackend(vlm.model, tokenizer, share_prompts=False, reuse_turns=False), tokenizer, "hf",
                         max_adapters)
        self.vlm = vlm
        self.chat = VisualChatFormat(vlm.processor, vlm.store)

    @property
    def max_context(self) -> int:
        return int(self.vlm.model.config.get_text_config().max_position_embeddings)

    def generate(self, policy_id: str, adapter_dir: str | None, prompt_token_ids: list[list[int]],
                 sampling: SamplingConfig, seed: int | None = None, rows: list[RowOptions] | None = None,
                 on_step: Callable[[list[int]], None] | None = None, images: list[str] | None = None) -> list[Sample]:
        """`ResidentPolicy.generate` where every prompt holds the placeholders of `images` (stored image ids, in
        placeholder order; None or [] for a prompt without images)."""
        # Before the lock: decoding and resizing need no model. Every row shows the request's images.
        vision = self.vlm.vision_inputs(images or []).repeat(len(prompt_token_ids)).to(self.vlm.model.device)

        def inputs(input_ids: Any) -> dict[str, Any]:  # the padded prompts (B, P)
            return vision.model_inputs(input_ids) | {"suppress_tokens": list(vision.banned_ids)}

        with self._lock, self._activate(adapter_dir):
            return self.backend.generate(prompt_token_ids, sampling, seed, rows, on_step=on_step, inputs=inputs)


def load_resident(base_model: str, engine: Engine, store: ImageStore, max_adapters: int = 8) -> ResidentPolicy:
    """The resident policy of a base model: a `VisualResidentPolicy` (images stored in `store`) when the model's
    config is a vision-language model's (`is_vision_language`), else `ResidentPolicy.load`."""
    from transformers import AutoConfig

    from stages.policy.model import resolve_model

    path = resolve_model(base_model)
    if not is_vision_language(AutoConfig.from_pretrained(path)):
        return ResidentPolicy.load(base_model, engine, max_adapters)
    if engine != "hf":
        raise ValueError(f"{base_model} is a vision-language model: only the hf engine serves it (vLLM's multimodal "
                         "path is not wired yet)")
    return VisualResidentPolicy(VLMPolicy.load(path, store), max_adapters)
