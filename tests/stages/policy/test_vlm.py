"""Vision-language policies with a real tiny Idefics3 (SmolVLM's architecture, random weights) and real peft:
images in the prompt and in a tool result, token-exact recording, log-probs recomputed from the stored
images, a GRPO step on stored visual samples reaching the LoRA weights, and clear errors on bad input."""

from __future__ import annotations

import base64
import io
from dataclasses import replace

import pytest
import torch
from PIL import Image

from stages.policy.sampling import SamplingConfig
from stages.policy.vlm import VLMPolicy, add_vlm_lora, text_content
from storage.images import ImageStore, data_url

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


@pytest.fixture(scope="module")
def policy(tiny_vlm_dir, tmp_path_factory) -> VLMPolicy:
    return VLMPolicy.load(tiny_vlm_dir, ImageStore(tmp_path_factory.mktemp("ws") / "images"))


@pytest.fixture(scope="module")
def group(policy):
    """Three samples of one two-image episode."""
    return policy.generate(episode((200, 0, 0), crop=True), n=3, sampling=SAMPLING, seed=3)


def test_a_visual_episode_is_recorded_token_exact_with_its_image_tokens_masked(policy, group):
    tok = policy.processor.tokenizer
    image_token = tok.convert_tokens_to_ids("<image>")
    prompt, image_ids = policy.prompt(episode((200, 0, 0), crop=True))
    assert prompt.count(image_token) == 2 * policy.processor.image_seq_len  # both images expanded
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


def test_a_grpo_step_on_stored_visual_samples_updates_the_language_lora_only(tiny_vlm_dir, tmp_path):
    from stages.policy.lora import LoRASettings
    from stages.update.config import GRPOConfig
    from stages.update.data import visual_training_sample
    from stages.update.train import make_optimizer, train_on_batch

    from storage.schema import Rollout, from_table, to_table
    from storage.workspace import Workspace
    from tests.factories import tool_episode

    base = VLMPolicy.load(tiny_vlm_dir, ImageStore(tmp_path / "ws" / "images"))
    policy = VLMPolicy(add_vlm_lora(base.model, LoRASettings(r=4, alpha=8)), base.processor, base.store)
    names = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n and "text_model" in n for n in names)  # not the vision tower
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
