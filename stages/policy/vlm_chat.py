"""A vision-language conversation grown token by token: `VisualChatFormat`, the `ChatFormat` of a VLM.

    chat = VisualChatFormat(policy.processor, policy.store)          # policy: stages.policy.vlm.VLMPolicy
    user = Message("user", marked_content([image_part, {"type": "text", "text": "How many?"}], policy.store))
    ids = chat.encode(chat.render([user], True))                     # image placeholders expanded
    ... sample a turn from ids with pixels = policy.vision_inputs(image_ids_of([user])) ...
    turn = Message("assistant", sampled_text)
    ids += sampled_ids + chat.encode(end)                            # end: chat.end_of_turn([user], turn), less the sampled EOS
    tool = Message("tool", marked_content([{"type": "text", "text": "zoomed:"}, crop_part], policy.store))
    ids += chat.encode(chat.tool_turn([user, turn], [tool]))        # the tool's image expanded too
    image_ids_of([user, turn, tool])                                 # the images of `ids`, in placeholder order

Records keep their images as references in the text of a message's content: each image part becomes
`<image:SHA256>` (`image_ref`), the id of the image in the workspace's store (storage/images.py), so a
conversation with images is still a list of `storage.schema.Message` (a string content, as the rollouts
table stores it) and the recorder, the agent loop and `ChatFormat.end_of_turn` / `tool_turn` work on it
unchanged. Only user, system and tool messages carry images: an assistant's content is the model's text,
never parsed for references.

`render` writes the processor's own chat template over the messages as content parts (`{"type": "image"}`
for each reference) and then replaces each image token the template wrote (`processor.image_token`:
`<image>` for Idefics3, `<|image_pad|>` for Qwen2-VL) with that image's expansion, the placeholder text the
processor itself makes of the image (Idefics3: `<fake_token_around_image><global-img>` + `image_seq_len` x
`<image>` + `<fake_token_around_image>`; its length can depend on the image's size). The processors build
their input ids the same way (expand, then tokenize the text), so `encode(render(...))` is the processor's
tokenization, and the difference between two renders (ChatFormat's way of growing a conversation) holds
exactly the new messages' placeholders. The images of a token sequence are the references of its
messages in order (`image_ids_of`): the order of their placeholders.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from stages.policy.chat import ChatFormat
from storage.images import IMAGE_REF, ImageStore, image_bytes_from_source, image_ref, marked_parts
from storage.schema import Message

_EXPANSIONS_KEPT = 4096  # expansion texts memoised per image id (a few hundred bytes each)


def marked_content(content: Any, store: ImageStore, file_root: Path | None = None) -> str | None:
    """An OpenAI message content (a string, or `text` / `image_url` parts) as a record's content: the text of
    its parts joined, each image validated, stored, and written as its reference. ValueError naming the
    problem: an image that does not decode or is not a data URL (or a file under `file_root`, see
    `storage.images.image_bytes_from_source`), a part that is neither, or text that spells a reference."""
    if not isinstance(content, list):
        _plain(content)
        return content
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "text" and isinstance(part.get("text"), str):
            out.append(_plain(part["text"]))
        elif kind == "image_url":
            url = part.get("image_url", {}).get("url") if isinstance(part.get("image_url"), dict) else None
            if not isinstance(url, str):
                raise ValueError("an image_url part needs {'image_url': {'url': 'data:image/...;base64,...'}}")
            out.append(image_ref(store.put(image_bytes_from_source(url, file_root)).image_id))
        else:
            raise ValueError(f"unsupported content part {kind!r}; expected 'text' or 'image_url'")
    return "".join(out)


def _plain(text: str | None) -> str | None:
    if text and IMAGE_REF.search(text):
        raise ValueError("message text may not contain an image reference (<image:SHA256>): send the image as an "
                         "image_url part")
    return text


def image_ids_of(messages: list[Message]) -> list[str]:
    """The ids of the images the messages refer to, in the order their placeholders appear when rendered."""
    return [i for m in messages if m.role != "assistant" for i in IMAGE_REF.findall(m.content or "")]


def parts(message: Message) -> list[dict[str, Any]]:
    """A record's content as the processor's chat template takes it: text and `{"type": "image"}` parts (one
    text part for a message without images, as `stages.policy.vlm.split_images` writes it)."""
    text = message.content or ""
    if message.role == "assistant" or not IMAGE_REF.search(text):
        return [{"type": "text", "text": text}]
    return [{"type": "image"} if kind == "image" else {"type": "text", "text": piece} for kind, piece in marked_parts(text)]


class VisualChatFormat(ChatFormat):
    """`ChatFormat` for a vision-language processor: renders with the processor's chat template and expands each
    image into its placeholder tokens (module docstring). Thread-safe: the policy service shares one."""

    def __init__(self, processor: Any, store: ImageStore) -> None:
        super().__init__(processor.tokenizer)
        self.processor = processor
        self.store = store
        self.image_token: str = processor.image_token
        self._expansions: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def render(self, messages: list[Message], generation_prompt: bool) -> str:
        """The template's text for `messages`, each image as its placeholder text. tool_calls are left out, as
        in `ChatFormat.render` (the assistant's raw text carries its calls)."""
        chat = [{k: v for k, v in m.to_openai().items() if k != "tool_calls"} | {"content": parts(m)} for m in messages]
        text = self.processor.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt)
        pieces = text.split(self.image_token)
        ids = image_ids_of(messages)
        if len(pieces) - 1 != len(ids):
            raise ValueError(f"the chat template wrote {len(pieces) - 1} image tokens {self.image_token!r} for "
                             f"{len(ids)} images (does a text hold the image token?)")
        out = [pieces[0]]
        for image_id, piece in zip(ids, pieces[1:]):
            out += [self.expansion(image_id), piece]
        return "".join(out)

    def expansion(self, image_id: str) -> str:
        """The placeholder text the processor makes of a stored image: its input ids for one image token and that
        image, as text that tokenizes back to exactly those ids (checked: ValueError otherwise)."""
        with self._lock:
            if image_id in self._expansions:
                self._expansions.move_to_end(image_id)
                return self._expansions[image_id]
        from stages.policy.vlm import _decode

        image = _decode(self.store.get(image_id))
        ids = list(self.processor(text=[self.image_token], images=[[image]], add_special_tokens=False)["input_ids"][0])
        text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if self.encode(text) != ids:
            raise ValueError(f"the processor's placeholder tokens for image {image_id} do not survive a decode and "
                             "re-encode; this processor's conversations cannot be grown token by token")
        with self._lock:
            self._expansions[image_id] = text
            while len(self._expansions) > _EXPANSIONS_KEPT:
                self._expansions.popitem(last=False)
        return text
