"""A small vision-language model assembled here, for CPU: SmolVLM's architecture (Idefics3) around a text model
we already have (SmolLM2-135M-Instruct by default), with a small SigLIP-style vision tower to be trained.

    model, processor = assemble_vlm(text_dir, VisionTower())      # random vision tower + connector
    text_logit_gap(model, text_dir, "What is 2+2?")               # ~0: the text model is copied exactly
    save_vlm(model, processor, out)                               # loadable by VLMPolicy.load(out, store)

No pretrained VLM can be downloaded on the machines rlops is tested on, so the model that shows GRPO learning
on a visual task is built from parts: the text model's weights are copied unchanged into the Idefics3 text
model and lm_head (its logits on a text-only prompt equal the text model's), the three image tokens SmolVLM
uses (and the `<end_of_utterance>` its processor adds) are added to its tokenizer (their embedding rows start at the mean of the others), and the vision tower
and the connector (pixel shuffle + one linear layer) start random: they learn to see by SFT on a task's
captions (examples/vision/build_small_vlm.py). It lives in the product, not in the example, because what it
builds is the model the visual learning config trains, and its weight copy is tested.

torch and transformers are imported inside the functions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from storage.atomic import atomic_dir

# Where `make small-vlm` (examples/vision/build_small_vlm.py) puts the model configs/visual_learn.yaml trains.
NAME = "SmolVLM-SmolLM2-135M-shapes"
FOLDER = f"$RLOPS_CACHE/models/{NAME}"  # storage.settings.expand_cache resolves it
BUILD_COMMAND = "make small-vlm"

IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>")  # Idefics3's processor writes these

# SmolLM2's own chat template (the same default system prompt), extended to OpenAI-style content parts: a text-only
# conversation renders exactly as SmolLM2 renders it, and an image part becomes the processor's `<image>` marker,
# which the processor expands into the image's placeholder tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class VisionTower:
    """The vision tower and connector: a SigLIP encoder sized for small synthetic images."""

    image_size: int = 64  # every image is resized to one square tile of this side (no splitting): the task draws 64 px
    patch_size: int = 8  # 8x8 patches: (64/8)^2 = 64 patch embeddings, fine enough for shapes a few px across
    hidden_size: int = 192  # small enough to train on CPU in minutes; SmolVLM's SigLIP uses 768
    intermediate_size: int = 768  # SigLIP's 4x MLP ratio
    num_hidden_layers: int = 4  # a few layers: counting needs some context across patches, not depth
    num_attention_heads: int = 4  # head dim 48
    scale_factor: int = 2  # Idefics3's pixel shuffle: 64 patches -> 16 image tokens per image

    @property
    def image_seq_len(self) -> int:
        """Placeholder tokens per image: the patches after pixel shuffle."""
        return (self.image_size // self.patch_size) ** 2 // self.scale_factor**2


def vlm_processor(tokenizer: Any, tower: VisionTower) -> Any:
    """An Idefics3 processor around `tokenizer` (already holding IMAGE_TOKENS): one `image_size` tile per image,
    `image_seq_len` placeholder tokens, CHAT_TEMPLATE."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    side = {"longest_edge": tower.image_size}
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size=side, max_image_size=side)
    return Idefics3Processor(image_processor=images, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE,
                             image_seq_len=tower.image_seq_len)


def assemble_vlm(text_dir: str | Path, tower: VisionTower, seed: int = 0) -> tuple[Any, Any]:
    """An Idefics3ForConditionalGeneration whose text model and lm_head are the causal LM in `text_dir` (a Llama,
    fp32), with a random `tower` vision encoder and connector (seeded), and its processor."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration

    text = AutoModelForCausalLM.from_pretrained(text_dir, dtype="float32")
    if text.config.model_type != "llama":
        raise ValueError(f"{text_dir} is a {text.config.model_type!r} model; the assembly copies a Llama text model")
    tokenizer = AutoTokenizer.from_pretrained(text_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    processor = vlm_processor(tokenizer, tower)  # before sizing the vocabulary: it adds <end_of_utterance> too
    text_config = {**text.config.to_dict(), "vocab_size": len(processor.tokenizer)}
    for key in ("architectures", "_name_or_path", "_model_name_or_path", "dtype", "transformers_version"):
        text_config.pop(key, None)
    vision = {k: v for k, v in asdict(tower).items() if k != "scale_factor"}
    config = Idefics3Config(vision_config=vision, text_config=text_config, scale_factor=tower.scale_factor,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                            tie_word_embeddings=text.config.tie_word_embeddings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(config).eval()
    _copy_text_model(text, model)
    return model, processor


def _copy_text_model(text: Any, vlm: Any) -> None:
    """The text model's weights into the VLM's text model and lm_head, unchanged; the added image tokens' rows
    (embedding and, if untied, lm_head) start at the mean of the existing rows."""
    import torch

    state = dict(text.model.state_dict())
    state["embed_tokens.weight"] = _with_mean_rows(state["embed_tokens.weight"], vlm.config.text_config.vocab_size)
    with torch.no_grad():
        missing, unexpected = vlm.model.text_model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"the text model does not fit Idefics3's: missing {missing}, unexpected {unexpected}")
        if not text.config.tie_word_embeddings:
            vlm.lm_head.weight.copy_(_with_mean_rows(text.lm_head.weight, vlm.config.text_config.vocab_size))
    vlm.tie_weights()


def _with_mean_rows(weight: Any, rows: int) -> Any:
    """`weight` (V, H) extended to (rows, H) by copies of its mean row."""
    import torch

    extra = weight.mean(0, keepdim=True).expand(rows - weight.shape[0], -1)
    return torch.cat([weight, extra], 0)


def text_logit_gap(vlm: Any, text_dir: str | Path, prompt: str) -> float:
    """The largest absolute difference between the VLM's and the text model's next-token logits over the text
    model's vocabulary, at every position of a text-only chat prompt: ~0 when the copy is exact."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    text = AutoModelForCausalLM.from_pretrained(text_dir, dtype="float32").eval()
    tokenizer = AutoTokenizer.from_pretrained(text_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]  # (1, T)
    with torch.no_grad():
        want = text(input_ids=ids).logits  # (1, T, V)
        got = vlm(input_ids=ids).logits[..., : want.shape[-1]]  # (1, T, V + image tokens) -> (1, T, V)
    return float((got - want).abs().max())


def save_vlm(model: Any, processor: Any, out: str | Path) -> Path:
    """The model and processor into one folder, whole or not at all (loadable by `VLMPolicy.load`)."""
    with atomic_dir(Path(out)) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        processor.save_pretrained(tmp)
    return Path(out)
