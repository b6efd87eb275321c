"""Vision-language policies: OpenAI content parts with images in, token-exact visual samples out.

    policy = VLMPolicy.load(model_dir, ImageStore(settings.images_dir))
    samples = policy.generate(messages, n=4, sampling=SamplingConfig(max_new_tokens=32), seed=7)
    samples[0].token_ids, samples[0].loss_mask, samples[0].behavior_logprobs, samples[0].image_ids
    visual_training_sample(policy, samples[0])  # stages.update.data: what GRPO trains on, pixels rebuilt

Messages carry OpenAI content parts, `[{"type": "text", "text": ...}, {"type": "image_url", "image_url":
{"url": "data:image/png;base64,..."}}]`, in any role (a user's screenshot, a tool's cropped view). Each image
is validated and stored content-addressed in the workspace (storage/images.py) before any compute; the
sample records its images by id, in the order their placeholder tokens appear.

The model is a transformers image-text-to-text class (`*ForConditionalGeneration` with a `vision_config`;
the tests build Idefics3 / SmolVLM, Qwen2-VL and Qwen2.5-VL) and its processor, loaded from one folder: the
processor's own chat template renders the messages and expands each image into its placeholder tokens (for
Idefics3: `<fake_token_around_image><global-img><image>*image_seq_len<fake_token_around_image>`; for Qwen2-VL:
`<|vision_start|><|image_pad|>*n<|vision_end|>`, n = the image's patches / merge_size**2). Those tokens are
prompt tokens, so `loss_mask` is 0 on them: only sampled tokens are trained.

The two families batch their image tensors differently, and `VisionInputs` is the one home of that: Idefics3
takes pixel_values (B, n_images, 3, H, W), each sequence's images padded to the batch's most with all-zero
images; Qwen2-VL takes every image's flattened patches concatenated over the batch, pixel_values (patches,
C*T*P*P), with image_grid_thw (n_images, 3) saying which patches are whose, and numbers positions with its
multimodal rope (M-RoPE) from the ids, the grid and the attention mask, for which it needs mm_token_type_ids
(1 on the image tokens; `VisionInputs.model_inputs` writes them for the padded ids of each call).

Pixel inputs are never stored: they are rebuilt from the stored image bytes by the processor's image
processor, whose settings are part of the model folder (`processor_fingerprint`, recorded per sample and
checked on rebuild). Generation uses the rebuilt inputs too, so the recorded behaviour log-probs are those of
exactly what training will feed the model, and recomputing them reproduces them (tests: to 1e-4).

The image-structure tokens are suppressed while sampling (`image_structure_ids`): a sampled `<image>` would
claim an image that does not exist. The recorded log-probs are those of the suppressed distribution, and the
recomputation (`stages.policy.logprobs.visual_token_logprobs`) suppresses the same ids.

torch and transformers are imported inside the functions that need them.
"""

from __future__ import annotations

import hashlib
import io
import json
import inspect
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.policy.model import MODEL_LOADING
from stages.policy.sampling import SamplingConfig, eos_token_ids
from storage.images import ImageStore, image_bytes_from_url

if TYPE_CHECKING:
    import torch

# The processor attributes that name image-structure tokens (Idefics3/SmolVLM, Qwen2-VL and LLaVA-style).
_IMAGE_TOKEN_ATTRS = ("image_token", "video_token", "fake_image_token", "global_image_tag", "vision_start_token",
                      "vision_end_token", "boi_token", "eoi_token")
# The model config fields that hold them where the processor does not name them (Qwen2-VL's vision start/end).
_IMAGE_TOKEN_ID_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def has_images(content: Any) -> bool:
    """Whether a message content (a string or a list of OpenAI content parts) holds an image part."""
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in content)


def text_content(content: Any, policy: str) -> str:
    """A text-only policy's view of a message content: the text of its parts joined; ValueError naming the
    policy when the content holds an image (the service answers 400): a text model cannot see it."""
    if isinstance(content, str) or content is None:
        return content or ""
    if has_images(content):
        raise ValueError(f"policy {policy!r} is text-only and cannot take image_url content parts; "
                         "use a vision-language base model")
    return "".join(_part_text(p) for p in content)


def _part_text(part: Any) -> str:
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise ValueError(f"unsupported content part {kind!r}; expected 'text' or 'image_url'")
    return part["text"]


def split_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[bytes]]:
    """Messages in the processor's chat format (`image_url` parts become `{"type": "image"}`) and the encoded
    bytes of their images, in order of appearance. ValueError on a part that is neither text nor image_url,
    or an image_url that is not a base64 data URL."""
    out, images = [], []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            out.append({**m, "content": [{"type": "text", "text": content or ""}]})
            continue
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "image_url":
                url = p.get("image_url", {}).get("url") if isinstance(p.get("image_url"), dict) else None
                if not isinstance(url, str):
                    raise ValueError("an image_url part needs {'image_url': {'url': 'data:image/...;base64,...'}}")
                images.append(image_bytes_from_url(url))
                parts.append({"type": "image"})
            else:
                parts.append({"type": "text", "text": _part_text(p)})
        out.append({**m, "content": parts})
    return out, images


def is_vision_language(config: Any) -> bool:
    """Whether a transformers model config (or its config.json as a dict) is a vision-language model's (it
    carries a vision tower)."""
    vision = config.get("vision_config") if isinstance(config, dict) else getattr(config, "vision_config", None)
    return vision is not None


def is_vision_language_model(base_model: str) -> bool:
    """Whether a base model reference is a vision-language model: a local folder whose config.json has a
    `vision_config`. Read as JSON (no transformers import), so a config check pays nothing for it. A hub id
    (no local folder) reads as text-only: point `base_model` at the VLM's folder."""
    config = Path(base_model).expanduser() / "config.json"
    return config.is_file() and is_vision_language(json.loads(config.read_text()))


def load_vlm_model(path: str | Path) -> Any:
    """The image-text-to-text model saved in a VLM's folder, fp32, eval mode (what `VLMPolicy.load` and the update
    workers load); ValueError if the folder is not a VLM's."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    if not is_vision_language(AutoConfig.from_pretrained(path)):
        raise ValueError(f"{path} is not a vision-language model (its config has no vision_config)")
    with MODEL_LOADING:
        return AutoModelForImageTextToText.from_pretrained(path, dtype="float32").eval()


def model_processor_fingerprint(base_model: str) -> str:
    """`processor_fingerprint` of the processor saved in a VLM's folder (part of its base policy's id)."""
    return processor_fingerprint(load_processor(Path(base_model).expanduser()))


def load_processor(path: Path) -> Any:
    """The processor saved in a VLM's folder (`AutoProcessor`). Where torchvision is missing (a CPU torch build
    without it), a processor that also takes videos (Qwen2-VL's, whose video processor needs torchvision in
    transformers 5) is loaded for images alone (`images_only`): rlops never sends it a video."""
    from transformers import AutoProcessor
    from transformers.models.auto.processing_auto import processor_class_from_name
    from transformers.utils import is_torchvision_available

    name = _saved_processor_class(path)
    cls = processor_class_from_name(name) if name else None
    if is_torchvision_available() or cls is None or "video_processor" not in inspect.signature(cls.__init__).parameters:
        return AutoProcessor.from_pretrained(path)
    return images_only(cls).from_pretrained(path)


def images_only(cls: type) -> type:
    """A processor class like `cls` (one whose `__init__` takes a video_processor) without its video processor:
    transformers builds and loads a processor's parts from its `__init__` parameters."""
    def __init__(self: Any, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                 **kwargs: Any) -> None:
        cls.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__})


def _saved_processor_class(path: Path) -> str | None:
    """The processor class a model folder names (processor_config.json, or the older files that carry it)."""
    for file in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        if (path / file).is_file() and (name := json.loads((path / file).read_text()).get("processor_class")):
            return name
    return None


def processor_fingerprint(processor: Any) -> str:
    """A hash of the image processor's settings (size, resampling, normalisation, splitting; Qwen2-VL's
    min/max pixels, patch, temporal patch and merge sizes) and the image token layout: what decides the pixel
    inputs and placeholder tokens an image becomes."""
    settings = processor.image_processor.to_dict()
    settings["image_seq_len"] = getattr(processor, "image_seq_len", None)
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class VisionInputs:
    """What a forward pass needs besides the tokens: the image tensors of one sequence (or a batch, after
    `stack` / `repeat`), the image-structure token ids that sampling suppressed (scored the same way), and, for
    a model that numbers positions by modality (Qwen2-VL's M-RoPE), the image token whose positions it is told.

    The layout of the tensors is the model's (module docstring): Idefics3's pixel_values (B, n_images, 3, H, W)
    and pixel_attention_mask (B, n_images, H, W), or Qwen2-VL's pixel_values (patches, C*T*P*P) and
    image_grid_thw (n_images, 3), recognised by the grid."""

    tensors: dict[str, Any]
    banned_ids: tuple[int, ...]
    token_type_id: int | None = None  # the image token that mm_token_type_ids marks; None: the model takes none

    @staticmethod
    def stack(items: list[VisionInputs]) -> VisionInputs:
        """A batch's inputs, one item per sequence in row order (a sequence without images has no tensors)."""
        seen = next((v.tensors for v in items if v.tensors), None)
        if seen is None:  # no sequence has an image
            return replace(items[0], tensors={})
        batch = _concatenated if "image_grid_thw" in seen else _padded
        return replace(items[0], tensors=batch([v.tensors for v in items], seen))

    def repeat(self, n: int) -> VisionInputs:
        """The inputs of n rows that all show this sequence's images (a group's samples of one prompt)."""
        return VisionInputs.stack([self] * n)

    def model_inputs(self, input_ids: torch.Tensor) -> dict[str, Any]:
        """The image arguments of a forward or generate call on input_ids (B, T) (padded as the call pads them)."""
        if not self.tensors or self.token_type_id is None:
            return dict(self.tensors)
        return {**self.tensors, "mm_token_type_ids": (input_ids == self.token_type_id).int()}  # (B, T)

    def to(self, device: Any) -> VisionInputs:
        return replace(self, tensors={k: v.to(device) for k, v in self.tensors.items()})


def _padded(rows: list[dict[str, Any]], like: dict[str, Any]) -> dict[str, Any]:
    """Idefics3's batch: each row's images (1, n_i, ...) padded with all-zero images to the most any row has,
    (B, most, ...) (Idefics3 drops all-zero images, as it does for its processor's own batches)."""
    import torch

    most = max(t["pixel_values"].shape[1] for t in rows if t)
    out = {}
    for key, first in like.items():
        parts = [t.get(key, first.new_zeros(1, 0, *first.shape[2:])) for t in rows]  # (1, n_i, ...)
        padded = [torch.cat([p, p.new_zeros(p.shape[0], most - p.shape[1], *p.shape[2:])], 1) for p in parts]
        out[key] = torch.cat(padded, 0)  # (B, most, ...)
    return out


def _concatenated(rows: list[dict[str, Any]], like: dict[str, Any]) -> dict[str, Any]:
    """Qwen2-VL's batch: every row's patches (p_i, C*T*P*P) and grids (n_i, 3) concatenated in row order, which
    is the order the model hands the images' features to the image tokens of the rows."""
    import torch

    return {key: torch.cat([t[key] for t in rows if t], 0) for key in like}


@dataclass
class VisualSample:
    """One sampled turn of a vision-language policy, recorded token-exact: `token_ids` = the prompt (image
    placeholder tokens included, loss_mask 0) followed by the sampled tokens (loss_mask 1)."""

    token_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]  # aligned with token_ids; 0 where loss_mask is 0
    image_ids: list[str]  # storage/images.py ids, in placeholder order
    processor: str  # processor_fingerprint of the processor that made the tokens and pixels
    text: str
    finish_reason: str  # stop | length


class VLMPolicy:
    """A vision-language model (peft-wrapped or not), its processor, and the workspace's image store."""

    def __init__(self, model: Any, processor: Any, store: ImageStore) -> None:
        self.model = model
        self.processor = processor
        self.store = store
        self.fingerprint = processor_fingerprint(processor)
        tokenizer = processor.tokenizer
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.banned_ids = image_structure_ids(processor, model.config)
        # Processors that hand the model mm_token_type_ids (Qwen2-VL's) mark its image token's positions.
        self.token_type_id = processor.image_token_id if getattr(processor, "return_mm_token_type_ids", False) else None

    @classmethod
    def load(cls, path: str | Path, store: ImageStore) -> VLMPolicy:
        """The model and processor saved in one folder (fp32, eval mode); ValueError if it is not a VLM."""
        return cls(load_vlm_model(path), load_processor(Path(path)), store)

    @classmethod
    def without_weights(cls, path: str | Path, store: ImageStore) -> VLMPolicy:
        """The policy's processor side only (`model` None): prompts, pixel inputs and recorded samples, for a
        generator that holds the weights itself (stages/policy/vllm_vlm.py). The EOS and image-structure ids
        come from the saved config and generation config, as `load` takes them from the model."""
        from types import SimpleNamespace

        from transformers import AutoConfig, GenerationConfig

        config = AutoConfig.from_pretrained(path)
        if not is_vision_language(config):
            raise ValueError(f"{path} is not a vision-language model (its config has no vision_config)")
        try:
            generation = GenerationConfig.from_pretrained(path)
        except OSError:  # no generation_config.json: the tokenizer's EOS
            generation = None
        policy = cls(SimpleNamespace(config=config, generation_config=generation), load_processor(Path(path)), store)
        policy.model = None
        return policy

    def render(self, messages: list[dict[str, Any]]) -> tuple[str, list[Any], list[str]]:
        """The generation prompt's text (one input placeholder per image, as the chat template writes it), its
        images decoded (RGB PIL) and their ids, each validated and stored first (ValueError naming a bad image
        before any compute)."""
        chat, images = split_images(messages)
        refs = [self.store.put(data) for data in images]
        text = self.processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        return text, [_decode(data) for data in images], [r.image_id for r in refs]

    def prompt(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[str]]:
        """The generation prompt's token ids (image placeholders expanded by the processor) and the ids of its
        images (`render`)."""
        text, pil, image_ids = self.render(messages)
        enc = self.processor(text=[text], images=[pil] if pil else None, add_special_tokens=False)
        return list(enc["input_ids"][0]), image_ids

    def vision_inputs(self, image_ids: list[str], processor: str | None = None) -> VisionInputs:
        """The pixel inputs of one sequence's images (no tensors for none), rebuilt from the stored bytes; ValueError
        when `processor` (a recorded fingerprint) is not this policy's: the pixels would differ."""
        if processor is not None and processor != self.fingerprint:
            raise ValueError(f"the episode was recorded with processor {processor}, this policy's is {self.fingerprint}: "
                             "its pixel inputs cannot be rebuilt exactly")
        if not image_ids:
            return VisionInputs({}, self.banned_ids, self.token_type_id)
        pil = [_decode(self.store.get(i)) for i in image_ids]
        tensors = dict(self.processor.image_processor(images=[pil], return_tensors="pt"))
        return VisionInputs(tensors, self.banned_ids, self.token_type_id)

    def generate(self, messages: list[dict[str, Any]], n: int, sampling: SamplingConfig,
                 seed: int | None = None) -> list[VisualSample]:
        """Sample n continuations of one conversation (a GRPO group: one prompt, no padding), recording the
        behaviour log-probs of every sampled token; deterministic for a given seed."""
        import torch
        from transformers import LogitsProcessorList

        from stages.policy.processors import _InverseCDFSampler, _LogprobRecorder

        prompt, image_ids = self.prompt(messages)
        vision = self.vision_inputs(image_ids)
        greedy = sampling.temperature == 0
        recorder = _LogprobRecorder(1.0 if greedy else sampling.temperature)
        processors: list[Any] = [recorder] + ([] if greedy else [_InverseCDFSampler(sampling.temperature, recorder)])
        device = self.model.device
        ids = torch.tensor([prompt] * n, device=device)  # (n, P)
        extra = vision.repeat(n).to(device).model_inputs(ids)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.inference_mode():
            torch.manual_seed(sampling.seed if seed is None else seed)
            out = self.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), **extra,
                do_sample=False, top_k=0, top_p=1.0, temperature=1.0, repetition_penalty=1.0,
                max_new_tokens=sampling.max_new_tokens, eos_token_id=sorted(self.eos_ids), pad_token_id=self.pad_id,
                # Before the recorder (transformers runs its own processors first): what is recorded is
                # the distribution that was sampled.
                suppress_tokens=list(self.banned_ids), logits_processor=LogitsProcessorList(processors),
            )  # (n, P + new); greedy at temperature 0, else our inverse-CDF sampler's pick
            new = out[:, len(prompt):]
            logprobs = recorder.finish(new[:, -1])  # (n, new)
        return [self.record(prompt, image_ids, row, lps) for row, lps in zip(new.tolist(), logprobs.tolist())]

    def record(self, prompt: list[int], image_ids: list[str], new: list[int], lps: list[float]) -> VisualSample:
        """One sampled turn as recorded: `new` (the sampled ids, cut after the first EOS) and their log-probs
        `lps` after `prompt` (the expanded prompt ids, loss_mask 0)."""
        end = next((i + 1 for i, t in enumerate(new) if t in self.eos_ids), None)
        sampled = new[:end]
        return VisualSample(
            token_ids=prompt + sampled, loss_mask=[0] * len(prompt) + [1] * len(sampled),
            behavior_logprobs=[0.0] * len(prompt) + lps[: len(sampled)], image_ids=image_ids,
            processor=self.fingerprint, text=self.processor.tokenizer.decode(sampled, skip_special_tokens=True),
            finish_reason="stop" if end is not None else "length",
        )

    def logprobs(self, sample: VisualSample, temperature: float = 1.0) -> torch.Tensor:
        """The recorded sample's log-probs recomputed from its tokens and stored images, (T,), 0 off the mask."""
        import torch

        from stages.policy.logprobs import visual_token_logprobs

        device = self.model.device
        ids = torch.tensor([sample.token_ids], device=device)
        vision = self.vision_inputs(sample.image_ids, sample.processor)
        with torch.no_grad():
            return visual_token_logprobs(self.model, ids, torch.ones_like(ids), vision.to(device),
                                         torch.tensor([sample.loss_mask], device=device), temperature)[0]


def image_structure_ids(processor: Any, config: Any = None) -> tuple[int, ...]:
    """The ids of the tokens that only the processor may write (image placeholders and their markers), named
    by the processor or by the model's `config` (Qwen2-VL's `<|vision_start|>` / `<|vision_end|>`)."""
    tokenizer = processor.tokenizer
    tokens = [getattr(processor, a) for a in _IMAGE_TOKEN_ATTRS if isinstance(getattr(processor, a, None), str)]
    ids = {tokenizer.convert_tokens_to_ids(t) for t in tokens}
    ids |= {getattr(config, f, None) for f in _IMAGE_TOKEN_ID_FIELDS}
    return tuple(sorted(i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id))


def _decode(data: bytes) -> Any:
    """Encoded (already validated) image bytes as an RGB PIL image."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")
