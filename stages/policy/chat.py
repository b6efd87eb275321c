"""How a conversation grows token by token under a chat template: `ChatFormat` and `difference`.

The built-in agent loop (stages/policy/agent_loop.py) and the policy service's recorder
(stages/service/recorder.py) grow a conversation's tokens with it: sampled tokens stay as sampled,
and only the template text around them is encoded, never the conversation again.
"""

from __future__ import annotations

from typing import Any

from storage.schema import Message


class ChatFormat:
    """The chat template's text between two states of a conversation, found by rendering both.

    Works for any template whose rendering of earlier messages does not change when a message is
    appended (chatml and most others; a template that rewrites history, e.g. one that drops the
    reasoning of earlier turns, is refused with a clear error).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def render(self, messages: list[Message], generation_prompt: bool) -> str:
        """The template's text for `messages`. tool_calls are left out: the assistant's raw text
        already carries the call tags, and a template with native tool-call rendering would print
        the calls a second time, unlike what the model sampled."""
        dicts = [{k: v for k, v in m.to_openai().items() if k != "tool_calls"} for m in messages]
        return self.tokenizer.apply_chat_template(dicts, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        # No special tokens added: the template text already holds whatever BOS/markers it wants.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def end_of_turn(self, history: list[Message], assistant: Message) -> str:
        """What the template writes after an assistant message's content (chatml: "<|im_end|>\\n")."""
        before = self.render(history, True) + (assistant.content or "")
        return difference(before, self.render(history + [assistant], False))

    def tool_turn(self, history: list[Message], tool_messages: list[Message]) -> str:
        """The tool messages followed by the next assistant generation prompt."""
        return difference(self.render(history, False), self.render(history + tool_messages, True))


def difference(before: str, after: str) -> str:
    """`after` minus its prefix `before`: the text a template writes between two states of a conversation
    (ValueError when `before` is not a prefix: a template that rewrites history)."""
    if not after.startswith(before):
        raise ValueError(
            "the chat template renders earlier messages differently once a message is appended, "
            f"so the conversation cannot be grown token by token (expected a prefix {before[-80:]!r})"
        )
    return after[len(before) :]
