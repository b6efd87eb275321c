"""Judge backends: an OpenAI-compatible chat-completions client over HTTP, and a local transformers model.

Both expose `model` (part of the judge cache key) and `complete(messages) -> Completion`.
The HTTP client bounds requests in flight with a semaphore, retries 429/5xx/timeouts with
exponential backoff, asks for JSON output when the server supports it, and never lets the API key
reach an exception, a log line or a returned text (`scrub`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

log = logging.getLogger(__name__)

RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}
MAX_BACKOFF_S = 60.0


class JudgeError(Exception):
    """The judge could not produce valid scores for a group (the group's rows get this as their error)."""


@dataclass(frozen=True)
class Completion:
    """One judge reply and what it cost."""

    content: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    schema_bound: bool = False  # the request carried a JSON schema the server accepted (its reply follows it)


class ChatClient(Protocol):
    """What `rank` needs from a judge backend."""

    model: str

    def complete(self, messages: list[dict[str, Any]], response_format: dict[str, Any] | None = None) -> Completion: ...


def scrub(text: str, secrets: list[str]) -> str:
    """`text` with every secret replaced by `***` (for anything that may be recorded or logged)."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


class OpenAIClient:
    """Chat completions against any OpenAI-compatible endpoint (vLLM, a hosted API, a proxy). Thread-safe."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key_env: str | None = None,
        timeout: float = 60.0,
        max_retries: int = 3,
        concurrency: int = 4,
        backoff: float = 1.0,
        json_mode: bool = True,
        temperature: float | None = 0.0,
        max_tokens: int | None = None,
    ) -> None:
        self.model = model
        self._url = base_url.rstrip("/") + "/chat/completions"
        key = os.environ.get(api_key_env) if api_key_env else None
        if api_key_env and not key:
            raise JudgeError(f"environment variable {api_key_env} (the judge API key) is not set")
        self._secrets = [key] if key else []
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.Client(headers=headers, timeout=timeout)
        self._slots = threading.BoundedSemaphore(concurrency)  # requests in flight, across all threads
        self._max_retries = max_retries
        self._backoff = backoff
        # Request fields some servers reject (JSON mode on small vLLM models, temperature on reasoning
        # models): a 400 that names one drops it for the rest of the run instead of failing every group.
        self._optional: dict[str, Any] = {
            "response_format": {"type": "json_object"} if json_mode else None,
            "temperature": temperature,
            "max_tokens": max_tokens,
        }
        self._schemas = True  # per-request JSON schemas, until a server refuses one

    def complete(self, messages: list[dict[str, Any]], response_format: dict[str, Any] | None = None) -> Completion:
        """Send one chat request, retrying transient failures; JudgeError (key-free) when it cannot succeed.
        `response_format` (a json_schema) binds the reply where the server takes it; a server that refuses it
        (a 400 naming response_format) is asked without it from then on (the Completion says which)."""
        attempt = 0
        while True:
            body: dict[str, Any] = {"model": self.model, "messages": messages}
            body.update((k, v) for k, v in self._optional.items() if v is not None)
            bound = response_format is not None and self._schemas
            if bound:
                body["response_format"] = response_format
            try:
                with self._slots:
                    resp = self._http.post(self._url, json=body)
            except httpx.TransportError as e:  # timeouts, refused/reset connections: worth another try
                reason, retry_after = f"{type(e).__name__}: {e}", None
            else:
                if resp.status_code == 200:
                    return self._parse(resp, bound)
                text = resp.text[:300]
                if resp.status_code == 400 and bound and "response_format" in text:
                    log.info("judge server refuses JSON schemas; asking without them (replies are validated)")
                    self._schemas = False
                    continue
                rejected = [k for k in body if k in self._optional and k in text]
                if resp.status_code == 400 and rejected:
                    # The prompt itself asks for JSON, so the judge still works without these fields.
                    log.info("judge server rejects %s; retrying without", ", ".join(rejected))
                    self._optional.update((k, None) for k in rejected)
                    continue
                reason = f"HTTP {resp.status_code}: {text}"
                if resp.status_code not in RETRY_STATUS:
                    raise JudgeError(self.scrub(f"judge request failed: {reason}"))
                retry_after = _seconds(resp.headers.get("retry-after"))
            if attempt >= self._max_retries:
                raise JudgeError(self.scrub(f"judge request failed after {attempt + 1} attempts: {reason}"))
            delay = min(MAX_BACKOFF_S, max(self._backoff * 2**attempt, retry_after or 0.0))
            log.warning("judge request failed (%s); retry %d/%d in %.2fs", self.scrub(reason)[:200], attempt + 1, self._max_retries, delay)
            time.sleep(delay)
            attempt += 1

    def _parse(self, resp: httpx.Response, bound: bool) -> Completion:
        try:
            data = resp.json()
            content = data["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise JudgeError(self.scrub(f"not a chat-completions response ({type(e).__name__}): {resp.text[:300]}")) from None
        usage = data.get("usage") or {}
        return Completion(content, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                          schema_bound=bound)

    def scrub(self, text: str) -> str:
        """`text` without this client's API key."""
        return scrub(text, self._secrets)


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP-date Retry-After: fall back to our own backoff


class TransformersClient:
    """A local judge: a causal LM folder or hub id run with transformers (greedy decoding). Thread-safe."""

    def __init__(self, model: str, max_new_tokens: int = 1024, device: str | None = None) -> None:
        # Heavy imports live here so `rewards` imports without torch (DESIGN.md, "Layout").
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = model
        self._torch = torch
        self._tok = AutoTokenizer.from_pretrained(model)
        self._lm = AutoModelForCausalLM.from_pretrained(model).to(device or "cpu").eval()
        self._max_new_tokens = max_new_tokens
        self._lock = threading.Lock()  # one generate at a time: the model is not shared-state safe

    def complete(self, messages: list[dict[str, Any]], response_format: dict[str, Any] | None = None) -> Completion:
        """Generate one reply to `messages` with the tokenizer's chat template (unconstrained: a
        `response_format` is not applied here, and the Completion says so)."""
        enc = self._tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        enc = {k: v.to(self._lm.device) for k, v in enc.items()}
        prompt_len = enc["input_ids"].shape[1]
        with self._lock, self._torch.no_grad():
            out = self._lm.generate(**enc, max_new_tokens=self._max_new_tokens, do_sample=False)
        new = out[0, prompt_len:]  # (T_new,)
        return Completion(self._tok.decode(new, skip_special_tokens=True), prompt_len, int(new.shape[0]))
