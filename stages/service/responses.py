"""The Responses API of the policy service (`POST /v1/responses`), on top of its chat machinery.

A Responses request is turned into the chat request it means (instructions -> the system message,
input items -> messages, `input_image` parts -> `image_url` parts, function tools -> chat tools,
max_output_tokens -> max_tokens), so it is sampled, batched, streamed and recorded exactly as a chat
call is (images: a vision-language policy's, see stages/service/service.py). Its one assistant turn comes back
as output items: a `message` (one `output_text` part) when the turn has text, a `function_call`
(`id: fc_...`, `call_id: call_...`) per tool call. A later request that sends those items back (the
`function_call` recognised by its `call_id`, with its name and arguments) continues the episode.

`previous_response_id`: responses are kept (unless `store: false`) in a bounded in-memory store,
least recently used dropped first; a request naming one gets that conversation (its input and
output, not its instructions, as OpenAI does) before its own input.

Streaming emits OpenAI's event sequence (`response.created`, `response.in_progress`, per item
`response.output_item.added`, the text's `content_part.added` / `output_text.delta` ... `done` or the
call's `function_call_arguments.delta` / `.done`, `response.output_item.done`, then
`response.completed` with the full output), each with `event:` line and `sequence_number`. Text
streams as it is sampled; tool calls come at the end of the turn, as in chat.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from stages.service.schemas import ChatRequest, ResponsesRequest
from stages.service.served import Caller
from stages.service.service import PolicyService, ServiceError


class ResponseStore:
    """Response id -> its conversation (chat message dicts), least recently used dropped past `size`."""

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self._items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[response_id] = messages
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> list[dict[str, Any]]:
        with self._lock:
            if response_id not in self._items:
                raise ServiceError(404, f"previous response {response_id!r} is not stored here (the store keeps the "
                                        f"last {self.size}, in memory)", "previous_response_not_found")
            self._items.move_to_end(response_id)
            return self._items[response_id]


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ResponsesAPI:
    """`POST /v1/responses`, plain and streamed, for a policy service."""

    def __init__(self, service: PolicyService, store: ResponseStore | None = None) -> None:
        self.service, self.store = service, store or ResponseStore()

    def _chat(self, req: ResponsesRequest) -> tuple[ChatRequest, list[dict[str, Any]]]:
        """The chat request a Responses request means, and its conversation without the instructions."""
        history = list(self.store.get(req.previous_response_id)) if req.previous_response_id else []
        history += req.messages()
        system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
        chat = ChatRequest(model=req.model, messages=system + history, tools=req.chat_tools(),
                           max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
                           tool_choice=_chat_tool_choice(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls)
        return chat, history

    def _output(self, choice: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """A chat choice as output items, and the assistant message it stores."""
        message = choice["message"]
        items: list[dict[str, Any]] = []
        if message["content"]:
            items.append({"type": "message", "id": _item_id("msg"), "role": "assistant", "status": "completed",
                          "content": [{"type": "output_text", "text": message["content"], "annotations": [],
                                       "logprobs": []}]})
        for call in message.get("tool_calls", []):
            items.append({"type": "function_call", "id": _item_id("fc"), "call_id": call["id"],
                          "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                          "status": "completed"})
        return items, message

    def _response(self, rid: str, req: ResponsesRequest, created: float, status: str,
                  output: list[dict[str, Any]], usage: dict[str, int] | None, finish: str | None) -> dict[str, Any]:
        incomplete = status == "completed" and finish == "length"
        return {
            "id": rid, "object": "response", "created_at": created, "model": req.model,
            "status": "incomplete" if incomplete else status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "output": output,
            "parallel_tool_calls": True, "previous_response_id": req.previous_response_id,
            "temperature": req.temperature, "top_p": req.top_p, "tool_choice": "auto", "tools": req.tools or [],
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "store": req.store is not False,
            "metadata": req.metadata or {}, "user": req.user,
            "usage": None if usage is None else {
                "input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"]},
        }

    def _keep(self, rid: str, req: ResponsesRequest, history: list[dict[str, Any]], message: dict[str, Any]) -> None:
        if req.store is not False:
            self.store.put(rid, history + [message])

    async def create(self, req: ResponsesRequest, caller: Caller) -> dict[str, Any]:
        """A plain (non-streamed) response."""
        chat, history = self._chat(req)
        body = await self.service.chat_completion(chat, caller)
        (choice,) = body["choices"]
        output, message = self._output(choice)
        rid = "resp_" + body["id"].removeprefix("chatcmpl-")
        self._keep(rid, req, history, message)
        return self._response(rid, req, time.time(), "completed", output, body["usage"], choice["finish_reason"])

    def stream(self, req: ResponsesRequest, caller: Caller) -> AsyncIterator[str]:
        """A streamed response: OpenAI's event sequence (module docstring). A request refused before
        generation raises here, an ordinary HTTP error; a failure during generation ends the stream
        with an `error` event and `response.failed`."""
        chat, history = self._chat(req)
        chat_id, _, events = self.service.chat_deltas(chat, caller)
        rid, created = "resp_" + chat_id.removeprefix("chatcmpl-"), time.time()
        seq = iter(range(1 << 30))

        def event(kind: str, **fields: Any) -> str:
            body = {"type": kind} | fields | {"sequence_number": next(seq)}
            return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

        async def run() -> AsyncIterator[str]:
            started = self._response(rid, req, created, "in_progress", [], None, None)
            yield event("response.created", response=started)
            yield event("response.in_progress", response=started)
            text_id, text = None, ""
            async for e in events:
                if e[0] == "error":
                    yield event("error", code="server_error", message=e[1], param=None)
                    failed = self._response(rid, req, created, "failed", [], None, None)
                    yield event("response.failed", response=failed | {"error": {"code": "server_error", "message": e[1]}})
                    return
                if e[0] == "text" or (e[0] == "end" and e[2][0]):
                    if text_id is None:
                        text_id = _item_id("msg")
                        yield event("response.output_item.added", output_index=0, item={
                            "type": "message", "id": text_id, "role": "assistant", "status": "in_progress", "content": []})
                        yield event("response.content_part.added", item_id=text_id, output_index=0, content_index=0,
                                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                    delta = e[2] if e[0] == "text" else e[2][0]
                    text += delta
                    yield event("response.output_text.delta", item_id=text_id, output_index=0, content_index=0,
                                delta=delta, logprobs=[])
                if e[0] != "end":
                    continue
                _, (choice,), _, usage = e
                output, message = self._output(choice)
                if text_id is not None:  # the streamed message item keeps the id it was announced with
                    output[0]["id"] = text_id
                    part = output[0]["content"][0]
                    yield event("response.output_text.done", item_id=text_id, output_index=0, content_index=0,
                                text=part["text"], logprobs=[])
                    yield event("response.content_part.done", item_id=text_id, output_index=0, content_index=0, part=part)
                    yield event("response.output_item.done", output_index=0, item=output[0])
                for index, item in enumerate(output):
                    if item["type"] != "function_call":
                        continue
                    yield event("response.output_item.added", output_index=index,
                                item=item | {"arguments": "", "status": "in_progress"})
                    yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=item["arguments"])
                    yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                arguments=item["arguments"])
                    yield event("response.output_item.done", output_index=index, item=item)
                self._keep(rid, req, history, message)
                yield event("response.completed",
                            response=self._response(rid, req, created, "completed", output, usage, choice["finish_reason"]))

        return run()


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Responses' `tool_choice` in chat's shape: the named form {type: function, name} becomes
    {type: function, function: {name}}; "auto", "none", "required" are the same in both."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice
