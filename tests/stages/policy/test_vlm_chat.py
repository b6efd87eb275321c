"""A vision-language conversation grown token by token (stages/policy/vlm_chat.py) with the real tiny Idefics3,
Qwen2-VL and Qwen2.5-VL processors: images in a user message and in a tool result, a sampled turn kept as
sampled, and the whole equal to the processor's own tokenization of the conversation."""

from __future__ import annotations

import pytest

from stages.policy.sampling import SamplingConfig
from stages.policy.vlm import VLMPolicy
from stages.policy.vlm_chat import VisualChatFormat, image_ids_of, image_ref, marked_content
from storage.images import ImageStore, image_id
from storage.schema import Message
from tests.conftest import VLM_ARCHITECTURES
from tests.stages.policy.test_vlm import image_part, image_tokens, png


@pytest.fixture(scope="module", params=VLM_ARCHITECTURES)
def policy(request, tiny_vlm, tmp_path_factory) -> VLMPolicy:
    return VLMPolicy.load(tiny_vlm(request.param), ImageStore(tmp_path_factory.mktemp("ws") / "images"))


def test_a_two_image_conversation_grows_to_the_processors_own_tokens(policy):
    chat = VisualChatFormat(policy.processor, policy.store)
    shot, crop = png((200, 0, 0)), png((0, 0, 200), (20, 50))
    user = Message("user", marked_content([image_part(shot), {"type": "text", "text": "How many squares?"}], policy.store))
    assert user.content == image_ref(image_id(shot)) + "How many squares?"
    ids = chat.encode(chat.render([user], True))
    assert ids == policy.prompt([{"role": "user", "content": [image_part(shot), {"type": "text", "text": "How many squares?"}]}])[0]

    (turn,) = policy.generate([{"role": "user", "content": [image_part(shot), {"type": "text", "text": "How many squares?"}]}],
                              n=1, sampling=SamplingConfig(max_new_tokens=6), seed=1)
    sampled = turn.token_ids[len(ids):]
    assistant = Message("assistant", turn.text)
    end = chat.end_of_turn([user], assistant)
    if sampled and sampled[-1] in policy.eos_ids:  # the sampled EOS starts the end-of-turn text (as the agent loop cuts it)
        end = end.removeprefix(policy.processor.tokenizer.decode(sampled[-1:], skip_special_tokens=False))
    ids = ids + sampled + chat.encode(end)
    tool = Message("tool", marked_content([{"type": "text", "text": "zoomed:"}, image_part(crop)], policy.store))
    ids += chat.encode(chat.tool_turn([user, assistant], [tool]))

    conversation = [user, assistant, tool]
    assert image_ids_of(conversation) == [image_id(shot), image_id(crop)]
    whole = [{"role": "user", "content": [image_part(shot), {"type": "text", "text": "How many squares?"}]},
             {"role": "assistant", "content": turn.text},
             {"role": "tool", "content": [{"type": "text", "text": "zoomed:"}, image_part(crop)]}]
    # The processor's own expansion and tokenization of the whole conversation: the same text, and the same
    # tokens outside the sampled turn (which stays as sampled, however the text would re-tokenize).
    theirs, decode = policy.prompt(whole)[0], policy.processor.tokenizer.decode
    assert decode(ids) == decode(theirs)
    first = len(chat.encode(chat.render([user], True)))
    rest = len(ids) - first - len(sampled)
    assert ids[:first] == theirs[:first] and ids[first:first + len(sampled)] == sampled
    assert ids[-rest:] == theirs[-rest:]
    placeholder = policy.processor.tokenizer.convert_tokens_to_ids(policy.processor.image_token)
    assert ids.count(placeholder) == image_tokens(policy, shot) + image_tokens(policy, crop)


@pytest.mark.parametrize("content, message", [
    ([{"type": "text", "text": "see <image:" + "a" * 64 + ">"}], "may not contain an image reference"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}], "does not decode"),
    ([{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}], "local image files are not enabled"),
    ([{"type": "input_audio"}], "unsupported content part 'input_audio'"),
], ids=["spelled-reference", "undecodable", "file-without-root", "audio"])
def test_bad_content_is_refused_by_name(policy, content, message):
    with pytest.raises(ValueError, match=message):
        marked_content(content, policy.store)


def test_local_files_are_read_only_under_the_image_root(policy, tmp_path):
    root = tmp_path / "shots"
    root.mkdir()
    (root / "a.png").write_bytes(png((1, 2, 3)))
    (tmp_path / "secret.png").write_bytes(png((4, 5, 6)))
    (root / "link.png").symlink_to(tmp_path / "secret.png")
    ok = marked_content([{"type": "image_url", "image_url": {"url": f"file://{root}/a.png"}}], policy.store, root)
    assert ok == image_ref(image_id(png((1, 2, 3))))
    assert marked_content([{"type": "image_url", "image_url": {"url": "a.png"}}], policy.store, root) == ok
    for url in (f"file://{tmp_path}/secret.png", "../secret.png", f"{root}/link.png"):
        with pytest.raises(ValueError, match="outside the image root"):
            marked_content([{"type": "image_url", "image_url": {"url": url}}], policy.store, root)
