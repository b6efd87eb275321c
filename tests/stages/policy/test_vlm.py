"""Vision-language policies with real tiny random VLMs of each architecture (Idefics3 / SmolVLM, whose images
batch padded per sequence, and Qwen2-VL / Qwen2.5-VL, whose patches batch concatenated with their grids and
whose positions are M-RoPE's) and real peft: images in the prompt and in a tool result, token-exact recording,
log-probs recomputed from the stored images, micro-batches mixing image counts, a GRPO step on stored visual
samples reaching the language model's LoRA weights only, and clear errors on bad input."""

from __future__ import annotations

import base64
import io
from dataclasses import replace

import pytest
import torch
from PIL import Image

from stages.policy.sampling import SamplingConfig
from stages.policy.lora import add_vlm_lora
from stages.policy.vlm import VLMPolicy, processor_fingerprint, text_content
from storage.images import ImageStore, data_url
from tests.conftest import VLM_ARCHITECTURES

SAMPLING = SamplingConfig(max_new_tokens=10)


def png(color: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def bmp() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, format="BMP")
    return buf.getvalue()


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


def episode(prompt_color: tuple[int, int, int], crop: bool) -> list[dict]:
    """A screenshot in the prompt, and (crop=True) a tool's zoomed view of it: a two-turn visual episode."""
    messages = [{"role": "user", "content": [image_part(png(prompt_color)), {"type": "text", "text": "How many squares?"}]}]
    if crop:
        messages += [{"role": "assistant", "content": "zoom(0, 0, 20, 20)"},
                     {"role": "tool", "content": [{"type": "text", "text": "zoomed:"}, image_part(png((0, 0, 200), (20, 50)))]}]
    return messages


# The tokens each architecture's processor writes around and for an image: never sampled.
IMAGE_STRUCTURE = {"idefics3": ["<fake_token_around_image>", "<image>", "<global-img>"],
                   "qwen2_vl": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]}
IMAGE_STRUCTURE["qwen2_5_vl"] = IMAGE_STRUCTURE["qwen2_vl"]


@pytest.fixture(scope="module", params=VLM_ARCHITECTURES)
def architecture(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def vlm_dir(tiny_vlm, architecture):
    return tiny_vlm(architecture)


@pytest.fixture(scope="module")
def policy(vlm_dir, tmp_path_factory) -> VLMPolicy:
    return VLMPolicy.load(vlm_dir, ImageStore(tmp_path_factory.mktemp("ws") / "images"))


def image_tokens(policy: VLMPolicy, data: bytes) -> int:
    """How many image tokens (`processor.image_token`) the processor expands one image into."""
    from stages.policy.vlm import _decode

    ids = policy.processor(text=[policy.processor.image_token], images=[[_decode(data)]])["input_ids"][0]
    return list(ids).count(policy.processor.tokenizer.convert_tokens_to_ids(policy.processor.image_token))


@pytest.fixture(scope="module")
def group(policy):
    """Three samples of one two-image episode."""
    return policy.generate(episode((200, 0, 0), crop=True), n=3, sampling=SAMPLING, seed=3)


def test_a_visual_episode_is_recorded_token_exact_with_its_image_tokens_masked(policy, group, architecture):
    tok = policy.processor.tokenizer
    image_token = tok.convert_tokens_to_ids(policy.processor.image_token)
    prompt, image_ids = policy.prompt(episode((200, 0, 0), crop=True))
    per_image = [image_tokens(policy, png((200, 0, 0))), image_tokens(policy, png((0, 0, 200), (20, 50)))]
    assert min(per_image) > 0 and prompt.count(image_token) == sum(per_image)  # both images expanded
    assert set(tok.convert_tokens_to_ids(IMAGE_STRUCTURE[architecture])) <= set(policy.banned_ids)
    for s in group:
        assert s.token_ids[: len(prompt)] == prompt and s.image_ids == image_ids
        sampled = s.token_ids[len(prompt):]
        assert s.loss_mask == [0] * len(prompt) + [1] * len(sampled) and len(sampled) > 0
        assert all(s.loss_mask[i] == 0 for i, t in enumerate(s.token_ids) if t in policy.banned_ids)
        assert not set(sampled) & set(policy.banned_ids)  # the processor's tokens are never sampled
        assert all(lp < 0 for lp in s.behavior_logprobs[len(prompt):])
    assert len({tuple(s.token_ids) for s in group}) > 1  # sampled, not greedy copies


def test_a_group_stores_its_shared_prompt_image_once(policy, group):
    files = sorted(p.stem for p in policy.store.root.rglob("*.parquet"))
    assert set(group[0].image_ids) <= set(files)
    assert policy.store.get(group[0].image_ids[0]) == png((200, 0, 0))
    before = len(files)
    policy.generate(episode((200, 0, 0), crop=True), n=2, sampling=SAMPLING, seed=4)
    assert len(list(policy.store.root.rglob("*.parquet"))) == before


def test_logprobs_recomputed_from_the_stored_images_reproduce_the_behaviour_logprobs(policy, group):
    for s in group:
        recomputed = policy.logprobs(s)
        assert torch.allclose(recomputed, torch.tensor(s.behavior_logprobs), atol=1e-4, rtol=0)
    # The pixels enter: the same tokens with another first image score differently.
    other = policy.store.put(png((0, 255, 0))).image_id
    swapped = replace(group[0], image_ids=[other, group[0].image_ids[1]])
    assert (policy.logprobs(swapped) - torch.tensor(group[0].behavior_logprobs)).abs().max() > 1e-3


def test_a_sample_from_another_processor_is_refused(policy, group):
    with pytest.raises(ValueError, match="recorded with processor"):
        policy.logprobs(replace(group[0], processor="0000"))


@pytest.mark.parametrize("setting", ["min_pixels", "max_pixels", "patch_size", "merge_size", "temporal_patch_size"])
def test_the_processor_fingerprint_covers_qwens_image_settings(tiny_vlm, setting):
    from stages.policy.vlm import load_processor

    processor = load_processor(tiny_vlm("qwen2_vl"))
    before = processor_fingerprint(processor)
    images = processor.image_processor
    if setting.endswith("pixels"):  # min/max pixels live in size as shortest/longest edge
        edge = "shortest_edge" if setting == "min_pixels" else "longest_edge"
        images.size = type(images.size)(**{**dict(images.size), edge: images.size[edge] * 2})
    else:
        setattr(images, setting, getattr(images, setting) * 2)
    assert processor_fingerprint(processor) != before


def test_a_micro_batch_mixing_image_counts_scores_each_sequence_as_alone(policy, group):
    """Two images, none, one: Idefics3 pads the rows' images, Qwen2-VL concatenates their patches and grids."""
    from stages.update.data import visual_training_sample
    from stages.update.train import _micro_batches

    text_only = policy.generate([{"role": "user", "content": "How many squares?"}], n=1, sampling=SAMPLING, seed=5)
    one_image = policy.generate(episode((0, 200, 0), crop=False), n=1, sampling=SAMPLING, seed=6)
    samples = [group[0], *text_only, *one_image]
    assert [len(s.image_ids) for s in samples] == [2, 0, 1]
    [batch] = _micro_batches([visual_training_sample(policy, s) for s in samples], size=3, device=torch.device("cpu"))
    with torch.no_grad():
        together = batch.logprobs(policy.model, 1.0)  # (3, T), right-padded, rows in batch.index's order
    assert sorted(batch.index.tolist()) == [0, 1, 2]
    for row, i in zip(together, batch.index.tolist()):
        alone = policy.logprobs(samples[i])
        assert torch.allclose(row[: len(alone)], alone, atol=1e-4, rtol=0) and alone.abs().sum() > 0


@pytest.mark.parametrize("content, message", [
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}], "does not decode"),
    ([{"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}], "base64 data URL"),
    ([{"type": "image_url", "image_url": {"url": "data:image/bmp;base64," + base64.b64encode(bmp()).decode()}}],
     "unsupported image format 'bmp'"),
    ([{"type": "input_audio", "input_audio": {}}], "unsupported content part 'input_audio'"),
], ids=["undecodable", "remote-url", "bmp", "audio"])
def test_bad_input_is_refused_before_any_compute(policy, content, message):
    with pytest.raises(ValueError, match=message):
        policy.generate([{"role": "user", "content": content}], n=1, sampling=SAMPLING, seed=0)


def test_a_text_only_policy_refuses_images_and_reads_text_parts():
    assert text_content([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "base") == "ab"
    assert text_content("plain", "base") == "plain"
    with pytest.raises(ValueError, match="policy 'base' is text-only"):
        text_content([image_part(png((1, 1, 1)))], "base")


def test_load_refuses_a_text_model(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="not a vision-language model"):
        VLMPolicy.load(tiny_model_dir, ImageStore(tmp_path))


def test_a_grpo_step_on_stored_visual_samples_updates_the_language_lora_only(vlm_dir, tmp_path):
    from stages.policy.lora import LoRASettings
    from stages.update.config import GRPOConfig
    from stages.update.data import visual_training_sample
    from stages.update.train import make_optimizer, train_on_batch

    from storage.schema import Rollout, from_table, to_table
    from storage.workspace import Workspace
    from tests.factories import tool_episode

    base = VLMPolicy.load(vlm_dir, ImageStore(tmp_path / "ws" / "images"))
    policy = VLMPolicy(add_vlm_lora(base.model, LoRASettings(r=4, alpha=8)), base.processor, base.store)
    names = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    language = {id(p) for p in policy.model.get_base_model().get_decoder().parameters()}
    # Only the language model's LoRA: not the vision tower, nor the projector / merger.
    assert names and all("lora_" in n and id(p) in language for n, p in policy.model.named_parameters() if p.requires_grad)
    # Two groups: two images (prompt + tool crop) and one image, so a micro-batch pads both tokens and images.
    samples = (policy.generate(episode((200, 0, 0), crop=True), n=2, sampling=SAMPLING, seed=1)
               + policy.generate(episode((0, 200, 0), crop=False), n=2, sampling=SAMPLING, seed=2))
    # Stored as rollout rows in a workspace's Parquet, then trained from what was read back (no regeneration):
    # tokens, mask, behaviour log-probs (float32) and image ids; the pixels come from the image store.
    ws = Workspace.open(tmp_path / "ws")
    rows = [replace(tool_episode("ro-vlm", i // 2, i % 2), token_ids=s.token_ids, loss_mask=s.loss_mask,
                    behavior_logprobs=s.behavior_logprobs, image_ids=s.image_ids) for i, s in enumerate(samples)]
    ws.write_part("rollouts", "ro-vlm", to_table(rows), part="part-00000")
    ws.catalog.complete_artifact("ro-vlm", "rollouts", "rollout", [], "cfg")
    stored = from_table(ws.query("SELECT * FROM rollouts ORDER BY rollout_id"), Rollout)
    assert [r.image_ids for r in stored] == [s.image_ids for s in samples]
    training = [visual_training_sample(policy, replace(s, token_ids=r.token_ids, loss_mask=r.loss_mask,
                                                       behavior_logprobs=r.behavior_logprobs, image_ids=r.image_ids))
                for s, r in zip(samples, stored)]
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    config = GRPOConfig(lr=1e-2, micro_batch_size=4, micro_batch_tokens=None)
    history = train_on_batch(policy.model, make_optimizer(policy.model, None, config), training,
                             torch.tensor([1.0, -1.0, 1.0, -1.0]), config, temperature=1.0)
    # On-policy first pass: the training forward (stacked images, right padding) matches the sampler.
    assert history[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and history[0]["grad_norm"] > 0
    changed = {n for n, p in policy.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= set(names)
    assert any("lora_B" in n for n in changed)
    nonzero_b = [n for n, p in policy.model.named_parameters() if "lora_B" in n and p.abs().sum() > 0]
    assert nonzero_b and set(nonzero_b) <= set(names)


def test_lora_projector_trains_the_connector_and_never_the_vision_tower(tiny_vlm_dir, tmp_path):
    from stages.common import identity
    from stages.policy.lora import LoRASettings
    from stages.update.config import GRPOConfig
    from stages.update.data import visual_training_sample
    from stages.update.train import make_optimizer, train_on_batch
    from storage.ids import config_hash

    base = VLMPolicy.load(tiny_vlm_dir, ImageStore(tmp_path / "images"))
    lora = LoRASettings(r=4, alpha=8, projector=True)
    policy = VLMPolicy(add_vlm_lora(base.model, lora), base.processor, base.store)
    names = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert any("connector" in n for n in names) and all("lora_" in n and "vision" not in n for n in names)
    samples = policy.generate(episode((200, 0, 0), crop=False), n=2, sampling=SAMPLING, seed=1)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    config = GRPOConfig(lr=1e-2, micro_batch_size=2, micro_batch_tokens=None, lora=lora)
    train_on_batch(policy.model, make_optimizer(policy.model, None, config),
                   [visual_training_sample(policy, s) for s in samples], torch.tensor([1.0, -1.0]), config, 1.0)
    changed = {n for n, p in policy.model.named_parameters() if not torch.equal(p, before[n])}
    assert any("connector" in n and "lora_B" in n for n in changed)  # B starts at 0: the projector's LoRA trained
    assert not any("vision_model" in n for n in changed)  # the vision tower did not move
    # The field is part of every config's identity when on (and leaves the ids of existing configs alone).
    assert config_hash(identity(config)) != config_hash(identity(config.model_copy(update={"lora": LoRASettings(r=4, alpha=8)})))
    assert "projector" not in identity(GRPOConfig())["lora"]
    with pytest.raises(ValueError, match="lora.projector needs a vision-language base model"):
        lora.peft_config()
