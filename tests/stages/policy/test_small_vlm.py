"""The small VLM's assembly with the tiny Llama as its text model: the weight copy is exact (text-only logits
equal the text model's), the image tokens are added, and the saved folder loads as a VLMPolicy that sees."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image
from transformers import AutoConfig

from stages.policy.sampling import SamplingConfig
from stages.policy.small_vlm import IMAGE_TOKENS, VisionTower, assemble_vlm, save_vlm, text_logit_gap
from stages.policy.vlm import VLMPolicy
from storage.images import ImageStore, data_url

TOWER = VisionTower(image_size=32, patch_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2)  # 16 patches -> 4 image tokens


@pytest.fixture(scope="module")
def assembled(tiny_model_dir):
    return assemble_vlm(tiny_model_dir, TOWER, seed=0)


def test_the_text_model_is_copied_exactly(assembled, tiny_model_dir):
    model, processor = assembled
    assert text_logit_gap(model, tiny_model_dir, "How many circles are there?") < 1e-5
    # Not vacuous: the same check on a VLM whose text model was left random fails.
    other, _ = assemble_vlm(tiny_model_dir, TOWER, seed=0)
    with torch.no_grad():
        other.model.text_model.layers[0].mlp.down_proj.weight.add_(0.1)
    assert text_logit_gap(other, tiny_model_dir, "How many circles are there?") > 1e-3


def test_the_image_tokens_are_added_with_mean_embeddings(assembled, tiny_model_dir):
    model, processor = assembled
    tok = processor.tokenizer
    ids = tok.convert_tokens_to_ids(list(IMAGE_TOKENS))
    text_vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    assert min(ids) >= text_vocab and model.config.text_config.vocab_size == len(tok)  # every token has a row
    emb = model.get_input_embeddings().weight
    assert model.lm_head.weight.data_ptr() == emb.data_ptr()  # tied, as in the text model
    assert torch.allclose(emb[ids[1]], emb[:text_vocab].mean(0), atol=1e-6)
    assert processor.image_seq_len == TOWER.image_seq_len == 4


def test_the_saved_model_loads_as_a_policy_whose_logprobs_depend_on_the_image(assembled, tmp_path):
    model, processor = assembled
    path = save_vlm(model, processor, tmp_path / "vlm")
    policy = VLMPolicy.load(path, ImageStore(tmp_path / "images"))
    image = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 0, 0)).save(image, format="PNG")
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image.getvalue())}},
                                              {"type": "text", "text": "How many shapes?"}]}]
    prompt, _ = policy.prompt(messages)
    assert prompt.count(processor.tokenizer.convert_tokens_to_ids("<image>")) == TOWER.image_seq_len
    sample = policy.generate(messages, n=1, sampling=SamplingConfig(max_new_tokens=4), seed=0)[0]
    assert torch.allclose(policy.logprobs(sample), torch.tensor(sample.behavior_logprobs), atol=1e-4, rtol=0)
