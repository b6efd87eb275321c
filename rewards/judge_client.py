"""Judge backends: an OpenAI-compatible chat-completions client over HTTP, and a local transformers model.

Both expose `model` (part of the judge cache key), `complete(messages) -> Completion` (a generated reply) and
`first_token(messages) -> Completion` (no reply: the judge's log-probabilities for its first token, read by the
pointwise and pairwise modes, rewards/judge_modes.py).
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
    top: tuple[tuple[str, float], ...] = ()  # first_token: (token text, log-prob) of the first token's candidates


class ChatClient(Protocol):
    """What `rank` needs from a judge backend."""

    model: str

    def complete(self, messages: list[dict[str, Any]], response_format: dict[str, Any] | None = None) -> Completion: ...

    def first_token(self, messages: list[dict[str, Any]], response_format: dict[str, Any] | None = None,
                    choices: tuple[str, ...] = ()) -> Completion: ...


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
        return self._send(messages, response_format, {})

    def first_token(self, messages: list[dict[str, Any]], response_format: dict[str, Any] | None = None,
                    choices: tuple[str, ...] = ()) -> Completion:
        """The judge's 20 most likely first tokens with their log-probs (`max_tokens: 1`, `logprobs`,
        `top_logprobs: 20`): one prefill, no reply. Under a `response_format` the server binds, they are the bound
        distribution's (rlops serve; vLLM reports the model's own). `choices` is for local backends (ignored)."""
        return self._send(messages, response_format, {"max_tokens": 1, "logprobs": True, "top_logprobs": 20})

    def _send(self, messages: list[dict[str, Any]], response_format: dict[str, Any] | None,
              fixed: dict[str, Any]) -> Completion:
        attempt = 0
        while True:
            body: dict[str, Any] = {"model": self.model, "messages": messages}
            body.update((k, v) for k, v in self._optional.items() if v is not None)
            body.update(fixed)
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
                    return self._parse(resp, bound, top="logprobs" in fixed)
                text = resp.text[:300]
                if resp.status_code == 400 and bound and ("response_format" in text or "schema" in text.lower()):
                    log.info("judge server refuses JSON schemas; asking without them (replies are validated)")
                    self._schemas = False
                    continue
                if resp.status_code == 400 and fixed and "logprobs" in text:
                    raise JudgeError(self.scrub(f"the judge server does not give first-token log-probs (the yes_no, "
                                                f"scale and pairwise modes read them; use mode: ranking): {text}"))
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

    def _parse(self, resp: httpx.Response, bound: bool, top: bool = False) -> Completion:
        try:
            data = resp.json()
            choice = data["choices"][0]
            content = choice["message"]["content"] or ""
            first = choice["logprobs"]["content"][0] if top else {}
            alternatives = [(str(a["token"]), float(a["logprob"])) for a in first.get("top_logprobs") or []]
            if top and not alternatives:  # no top_logprobs: the sampled token alone is all there is
                alternatives = [(str(first["token"]), float(first["logprob"]))]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            what = "with first-token log-probs " if top else ""
            raise JudgeError(self.scrub(f"not a chat-completions response {what}({type(e).__name__}): "
                                        f"{resp.text[:300]}")) from None
        usage = data.get("usage") or {}
        return Completion(content, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                          schema_bound=bound, top=tuple(alternatives))

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
        self._choice_tokens: dict[tuple[str, ...], list[int]] = {}

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

    def first_token(self, messages: list[dict[str, Any]], response_format: dict[str, Any] | None = None,
                    choices: tuple[str, ...] = ()) -> Completion:
        """One forward pass, no generation: the log-probs of every vocabulary token whose text is one of `choices`
        (stripped, any case), plus the 20 most likely tokens. Unbound: `response_format` is not applied."""
        torch = self._torch
        enc = self._tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        enc = {k: v.to(self._lm.device) for k, v in enc.items()}
        with self._lock, torch.no_grad():
            logits = self._lm(**enc).logits[0, -1].float()  # (V,): the next token's, after the whole prompt
        logprobs = torch.log_softmax(logits, dim=-1)
        wanted = {c.lower() for c in choices}
        if choices not in self._choice_tokens:
            vocab = self._tok.convert_ids_to_tokens(list(range(len(self._tok))))
            self._choice_tokens[choices] = [
                i for i, t in enumerate(vocab) if t is not None
                and self._tok.convert_tokens_to_string([t]).strip().lower() in wanted]
        ids = sorted(set(self._choice_tokens[choices]) | set(logprobs.topk(20).indices.tolist()))
        top = tuple((self._tok.decode([i]), float(logprobs[i])) for i in ids)
        return Completion("", int(enc["input_ids"].shape[1]), 0, top=top)
