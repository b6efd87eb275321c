"""Generation backends: sample assistant turns and record each sampled token's log-prob.

One small interface, `Backend.generate(prompt_token_ids, sampling, seed) -> list[Sample]`, with two
implementations: `HFBackend` (transformers, batched, the CPU default) and `VLLMBackend` (GPU, LoRA
adapters hot-loaded per policy id).

The behavior log-prob of a sampled token is log_softmax(logits / temperature) at that token: the
same definition the GRPO stage uses when it recomputes log-probs. top_p truncation changes which
tokens can be drawn but is NOT part of the definition (greedy decoding, temperature 0, records the
log-probs at temperature 1).

torch, transformers and vllm are imported inside the functions that need them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SamplingConfig:
    """How one assistant turn is sampled (stored as JSON in `rollouts.sampling`)."""

    # The policy's own distribution: the behavior log-probs and the GRPO ratio then describe what
    # was actually sampled; other values are allowed (the log-probs follow the temperature).
    temperature: float = 1.0
    # No nucleus truncation: with top_p < 1 the sampler draws from a truncated distribution that
    # the recorded log-probs (untruncated, see module docstring) do not describe exactly.
    top_p: float = 1.0
    # Per assistant turn: room for a tool call or a short answer from a small model, and a bound
    # on what one rambling turn costs. The whole episode is bounded by `max_total_tokens`.
    max_new_tokens: int = 256
    # The model's EOS ends a turn; stop strings are opt-in (e.g. "</tool_call>" to cut a turn
    # right after a call). The stop string stays in the text and the tokens.
    stop: tuple[str, ...] = ()
    # Base seed of a rollout batch; each generate call's seed derives from it, so reruns repeat.
    seed: int = 0


@dataclass
class Sample:
    """One sampled assistant turn.

    `token_ids` are the sampled tokens, ending with EOS when the model emitted one (EOS is a
    policy action, so it is trained on); `logprobs` are aligned with them. `text` is
    `tokenizer.decode(token_ids minus a final EOS)` with special tokens kept, so it renders back
    to exactly these tokens. `finish_reason` is "stop" (EOS or a stop string) or "length".
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


class Backend(Protocol):
    """What the agent loop needs from a generation engine."""

    eos_ids: set[int]  # token ids that end an assistant turn

    def generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingConfig, seed: int | None = None
    ) -> list[Sample]:
        """Sample one continuation per prompt (same order); `seed` defaults to `sampling.seed`."""
        ...


def decode_turn(tokenizer: Any, token_ids: list[int], eos_ids: set[int]) -> str:
    """The text of a sampled turn: the tokens minus a final EOS, special tokens kept, no clean-up,
    so that the chat template renders it back to the same characters."""
    if token_ids and token_ids[-1] in eos_ids:
        token_ids = token_ids[:-1]
    return tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """The ids that end an assistant turn: the generation config's EOS (an int or a list), else the
    tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


class _LogprobRecorder:
    """A logits processor that records log_softmax(logits / T) at each sampled token.

    transformers runs custom processors after its own (none are configured here) and before the
    sampling warpers (temperature, top_p), so `scores` are the raw logits. The token sampled from
    step t's scores shows up as the last column of `input_ids` at step t+1, so only one step of
    logits is kept alive: O(B * V) memory instead of the O(B * T * V) of `output_logits=True`.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self._scores: torch.Tensor | None = None  # (B, V) raw logits of the previous step
        self._logprobs: list[torch.Tensor] = []  # per step, (B,)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._scores is not None:
            self._collect(input_ids[:, -1])
        # The warpers after this one return new tensors (no in-place edits), so a reference suffices.
        self._scores = scores
        return scores

    def _collect(self, tokens: torch.Tensor) -> None:
        import torch

        z = self._scores.float()  # (B, V)
        if self.temperature != 1.0:
            z = z / self.temperature
        # log_softmax at one token = z[token] - logsumexp(z): no (B, V) log-prob tensor is written.
        picked = z.gather(1, tokens[:, None]).squeeze(1)  # (B,)
        self._logprobs.append(picked - torch.logsumexp(z, dim=-1))

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """Log-probs of all generated tokens, (B, n); `last_tokens` (B,) were sampled at the last step."""
        import torch

        self._collect(last_tokens)
        self._scores = None
        return torch.stack(self._logprobs, dim=1)


class _InverseCDFSampler:
    """Draws each row's next token itself and hands `generate` a score row where only that token is finite,
    so generate's greedy step takes it. The draw is exact inverse-CDF sampling: one uniform per row against
    the cumulative softmax (float64). `torch.multinomial` over SmolLM2's 49k vocabulary costs ~30 ms per
    decoding step for 32 rows on 2 CPU cores (a sixth of generation), most of it drawing random numbers
    for the whole vocabulary; this draws one per row. Seeded by the global RNG, as generate's sampling is.
    Used when top_p == 1 (no truncation to implement)."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        import torch

        cdf = torch.softmax(scores.double() / self.temperature, dim=-1).cumsum(-1)  # (B, V)
        u = torch.rand(cdf.shape[0], 1, dtype=torch.float64, device=cdf.device) * cdf[:, -1:]  # (B, 1)
        pick = torch.searchsorted(cdf, u, right=True).clamp(max=cdf.shape[1] - 1)  # (B, 1): first cdf > u
        return torch.full_like(scores, float("-inf")).scatter_(1, pick, 0.0)


class HFBackend:
    """Batched sampling with `transformers`' `generate` (left padding, seeded, CPU or GPU)."""

    def __init__(self, model: Any, tokenizer: Any, share_prompts: bool = True, reuse_turns: bool = True) -> None:
        self.model = model
        self.tokenizer = tokenizer
        # Identical prompts in a batch (the G samples of a group, on their first turn) are prefilled once
        # and their key/value cache copied to every row that shares them (`_shared_prefill`).
        self.share_prompts = share_prompts
        # Inside `conversation()`, a prompt that extends a row of the previous call (an agent's next turn)
        # prefills only its new tokens (`_reuse_prefill`).
        self.reuse_turns = reuse_turns
        self._kept: _KeptCache | None = None
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)

    def generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingConfig, seed: int | None = None
    ) -> list[Sample]:
        """Sample one turn per prompt in one left-padded batch; deterministic for a given seed."""
        import torch
        from transformers import LogitsProcessorList

        device = self.model.device
        width = max(len(ids) for ids in prompt_token_ids)
        input_ids = torch.full((len(prompt_token_ids), width), self.pad_id, dtype=torch.long)  # (B, P)
        attention_mask = torch.zeros_like(input_ids)  # (B, P), 0 on the left padding
        for row, ids in enumerate(prompt_token_ids):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention_mask[row, width - len(ids) :] = 1

        greedy = sampling.temperature == 0
        recorder = _LogprobRecorder(1.0 if greedy else sampling.temperature)
        processors = [recorder]
        fast = not greedy and sampling.top_p >= 1.0  # sample in our processor, let generate take its pick
        if fast:
            processors.append(_InverseCDFSampler(sampling.temperature))
        kwargs: dict[str, Any] = dict(
            do_sample=not greedy and not fast,
            temperature=1.0 if greedy or fast else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            top_k=0,  # transformers defaults to top_k=50; sample from the full distribution
            # A model's generation_config may set a penalty (Qwen2.5-Instruct: 1.05); it would run
            # before the recorder and make the recorded log-probs differ from the policy's.
            repetition_penalty=1.0,
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=sorted(self.eos_ids),
            pad_token_id=self.pad_id,
            logits_processor=LogitsProcessorList(processors),
        )
        if sampling.stop:
            kwargs.update(stop_strings=list(sampling.stop), tokenizer=self.tokenizer)

        devices = [device] if device.type == "cuda" else []
        # fork_rng: seed without disturbing the caller's global RNG state.
        with torch.random.fork_rng(devices=devices), torch.inference_mode():
            torch.manual_seed(sampling.seed if seed is None else seed)
            input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
            keep = self._kept is not None
            cache = self._kept.prefill(prompt_token_ids, width) if keep else None
            if cache is None and self.share_prompts:
                cache = self._shared_prefill(prompt_token_ids, input_ids, attention_mask)
            cache = _growing(cache if cache is not None else self._empty_cache())
            if cache is not None:
                kwargs[_cache_kwarg()] = cache
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                      return_dict_in_generate=keep, **kwargs)
            sequences = out.sequences if keep else out  # (B, P + n)
            new = sequences[:, width:]  # (B, n)
            logprobs = recorder.finish(new[:, -1])  # (B, n)
        samples = [self._sample(ids, lps, sampling) for ids, lps in zip(new.tolist(), logprobs.tolist())]
        if keep:
            kept = [p + s.token_ids for p, s in zip(prompt_token_ids, samples)]
            self._kept.keep(kept, width, prompt_token_ids, getattr(out, _cache_kwarg()))
        return samples

    def _empty_cache(self) -> Any:
        """A fresh cache for the model (generate would make the same one)."""
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @contextmanager
    def conversation(self) -> Iterator[None]:
        """Keep each generate call's key/value cache until the next call, for as long as the block runs.

        A prompt that begins with a kept row's tokens (an agent episode's next turn: its previous prompt, the
        sampled turn, then tool results) then prefills only what is new, instead of the whole conversation
        again; vLLM gets the same from its prefix cache. Sampling is unchanged: the same tokens and log-probs
        up to float rounding. The cache holds one policy's keys and values, so the block must not span a
        change of adapter; the agent loop opens one per `run_episodes`. Nothing is kept with `reuse_turns`
        off, or for a model whose cache is not a plain full-attention `DynamicCache`."""
        if not self.reuse_turns or self._kept is not None:
            yield
            return
        self._kept = _KeptCache()
        try:
            yield
        finally:
            self._kept = None

    def _shared_prefill(self, prompts: list[list[int]], input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        """When rows repeat a prompt: run the distinct prompts (all but their last token) once and give
        every row a copy of its prompt's key/value cache (for `generate`, which then runs only the last
        prompt token per row). None when every prompt is distinct."""
        import torch

        first: dict[tuple[int, ...], int] = {}
        rows = [first.setdefault(tuple(ids), i) for i, ids in enumerate(prompts)]
        if len(first) == len(prompts) or input_ids.shape[1] < 2:
            return None
        distinct = torch.tensor(sorted(first.values()), device=input_ids.device)  # (U,) first row of each prompt
        slot = {row: k for k, row in enumerate(distinct.tolist())}
        ids, mask = input_ids[distinct, :-1], attention_mask[distinct, :-1]  # (U, P-1)
        # Left padding: positions count real tokens only, as generate computes them from the mask.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        cache = getattr(out, _cache_kwarg())
        cache.batch_select_indices(torch.tensor([slot[r] for r in rows], device=input_ids.device))  # (B, ...)
        return cache

    def _sample(self, ids: list[int], lps: list[float], sampling: SamplingConfig) -> Sample:
        """Cut one generated row where it really ended (EOS, stop string, or max length); the rest
        is padding added after the row finished while others were still generating."""
        end = next((i + 1 for i, t in enumerate(ids) if t in self.eos_ids), None)
        if sampling.stop:
            stop_end = self._stop_end(ids[:end], sampling.stop)
            if stop_end is not None and (end is None or stop_end < end):
                end = stop_end
        reason = "stop" if end is not None else "length"
        ids = ids[:end]
        return Sample(ids, lps[: len(ids)], decode_turn(self.tokenizer, ids, self.eos_ids), reason)

    def _stop_end(self, ids: list[int], stops: tuple[str, ...]) -> int | None:
        """The smallest k such that the first k tokens' text contains a stop string (where
        transformers' stop-string criterion fired), by bisection; None if none occurs."""

        def hit(k: int) -> bool:
            text = self.tokenizer.decode(ids[:k], skip_special_tokens=False)
            return any(s in text for s in stops)

        if not hit(len(ids)):
            return None
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if hit(mid) else (mid + 1, hi)
        return lo


class _KeptCache:
    """The key/value cache of the last generate call and which tokens each of its rows holds (`HFBackend.conversation`)."""

    def __init__(self) -> None:
        self.cache: Any = None  # a DynamicCache, (B_old, heads, T_old, head_dim) per layer, left-padded rows
        self.rows: list[tuple[Any, int]] = []  # per old row: (its cached tokens as a numpy array, first column)

    def keep(self, tokens: list[list[int]], width: int, prompts: list[list[int]], cache: Any) -> None:
        """Remember `cache` from a batch of left-padded prompts (`width` columns): row r holds `tokens[r]` (prompt
        + sampled turn) from column width - len(prompts[r]), up to the cache's length (the last token sampled
        in the batch was never fed back, so its keys are missing)."""
        import numpy as np

        self.cache, self.rows = None, []
        if not _plain(cache):
            return  # sliding-window, static or quantized caches: not reused
        length = cache.get_seq_length()
        for ids, prompt in zip(tokens, prompts):
            start = width - len(prompt)
            self.rows.append((np.asarray(ids[: length - start], dtype=np.int64), start))
        self.cache = cache

    def prefill(self, prompts: list[list[int]], width: int) -> Any:
        """A cache for this batch built from the kept rows: each prompt's longest kept prefix, aligned so that
        only the last `new` columns of every row still need a forward pass; None when nothing is kept or
        matches. Left padding fixes the layout: rows end together, so the uncached block is as wide as
        the longest uncached suffix, and a row with a shorter one recomputes a few cached tokens."""
        import numpy as np
        import torch

        if self.cache is None:
            return None
        matched = [self._longest_prefix(np.asarray(p, dtype=np.int64)) for p in prompts]  # (old row, length)
        new = max(len(p) - n for p, (_, n) in zip(prompts, matched))  # >= 1: the last prompt token is never cached
        cached = width - new
        if cached < 1 or all(n == 0 for _, n in matched):
            return None
        source_row = torch.zeros(len(prompts), dtype=torch.long)  # (B,)
        source_col = torch.zeros(len(prompts), cached, dtype=torch.long)  # (B, cached); padding reads column 0
        for i, (p, (row, _)) in enumerate(zip(prompts, matched)):
            k = len(p) - new  # this row's tokens inside the cached columns (<= its match)
            if k > 0:
                source_row[i] = row
                source_col[i, cached - k :] = torch.arange(self.rows[row][1], self.rows[row][1] + k)
        device = self.cache.layers[0].keys.device
        source_row, source_col = source_row.to(device)[:, None], source_col.to(device)
        for layer in self.cache.layers:  # (B_old, H, T_old, D) -> (B, H, cached, D)
            layer.keys = layer.keys.transpose(1, 2)[source_row, source_col].transpose(1, 2).contiguous()
            layer.values = layer.values.transpose(1, 2)[source_row, source_col].transpose(1, 2).contiguous()
        cache, self.cache, self.rows = self.cache, None, []  # the new call's cache replaces it when it ends
        return cache

    def _longest_prefix(self, prompt: Any) -> tuple[int, int]:
        """(kept row, n): the kept row sharing the longest prefix with `prompt`, and that prefix's length,
        at most len(prompt) - 1 (generate needs one token to run)."""
        import numpy as np

        best = (0, 0)
        for row, (ids, _) in enumerate(self.rows):
            m = min(len(ids), len(prompt) - 1)
            if m <= best[1]:
                continue
            differ = np.flatnonzero(ids[:m] != prompt[:m])
            n = int(differ[0]) if differ.size else m
            if n > best[1]:
                best = (row, n)
        return best


def _cache_kwarg() -> str:
    """What generate and forward call the key/value cache: `cache` since transformers 5, `past_key_values` before."""
    from transformers.generation import utils

    return getattr(utils, "ALL_CACHE_NAMES", ["past_key_values"])[0]


def _plain(cache: Any) -> bool:
    """Whether `cache` is a full-attention dynamic cache (every layer a plain or growing `DynamicLayer`)."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) in (DynamicLayer, _growing_layer()) for layer in layers)


def _growing(cache: Any) -> Any:
    """`cache` with every layer appending in place (`_growing_layer`), or None when it is not `_plain` (a
    sliding-window or hybrid model: generate then makes its own). A new cache has no layers yet: they are
    made as the model first writes to them."""
    from transformers.cache_utils import DynamicLayer

    growing = _growing_layer()
    if not getattr(cache, "layers", None):
        if getattr(cache, "layer_class_to_replicate", None) is not DynamicLayer:
            return None
        cache.layer_class_to_replicate = growing
        return cache
    if not _plain(cache):
        return None
    cache.layers = [growing.holding(layer) for layer in cache.layers]
    return cache


_GROWING_LAYER: type | None = None


def _growing_layer() -> type:
    """A `DynamicLayer` that appends into a preallocated buffer. transformers' concatenates the whole cache
    with each step's one new token, copying it all every decoding step, in every layer: with 32 rows of
    ~600 tokens on 2 CPU cores that was most of a decoding step (docs/BENCHMARKS.md). This one copies
    only the new token, and grows by doubling when full. `keys`/`values` stay views of the valid part, so
    code reading them (attention, `_KeptCache`) sees a normal layer; anything that reassigns them
    (`batch_select_indices`, a crop) is noticed at the next append, which then starts a new buffer."""
    global _GROWING_LAYER
    if _GROWING_LAYER is not None:
        return _GROWING_LAYER
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        reserve = 128  # free slots allocated beyond what is written: a turn's decoding steps, usually

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._keys = self._values = None  # (B, H, capacity, D) buffers

        @classmethod
        def holding(cls, layer: Any) -> Any:
            """A growing layer holding `layer`'s keys and values (copied into a buffer at the first append)."""
            grown = cls()
            if layer.is_initialized:
                grown.lazy_initialization(layer.keys, layer.values)
                grown.keys, grown.values = layer.keys, layer.values
            return grown

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            old = self.keys.shape[-2] if self.keys.dim() == 4 else 0
            n = old + key_states.shape[-2]
            owned = self._keys is not None and self.keys.data_ptr() == self._keys.data_ptr() \
                and self.keys.shape[0] == self._keys.shape[0]
            if not owned or n > self._keys.shape[-2]:
                capacity = max(n + self.reserve, 2 * old)
                self._keys, self._values = (self._buffer(current, new, old, capacity)
                                            for current, new in ((self.keys, key_states), (self.values, value_states)))
            self._keys[:, :, old:n] = key_states
            self._values[:, :, old:n] = value_states
            self.keys, self.values = self._keys[:, :, :n], self._values[:, :, :n]
            return self.keys, self.values

        @staticmethod
        def _buffer(current: Any, new: Any, old: int, capacity: int) -> Any:
            b, h, _, d = new.shape
            buffer = new.new_empty(b, h, capacity, d)
            if old:
                buffer[:, :, :old] = current
            return buffer

    _GROWING_LAYER = GrowingLayer
    return GrowingLayer


class VLLMBackend:
    """vLLM on a GPU, one engine per base model, LoRA adapters hot-loaded per policy id.

    Log-probs: the engine runs with `logprobs_mode="processed_logprobs"`, i.e. log_softmax of the
    logits after temperature scaling (and after top-k/top-p masking). With top_p == 1 that is
    exactly log_softmax(logits / T), the definition above, so `generate` refuses top_p < 1 rather
    than record nucleus-renormalised values. The default "raw_logprobs" would ignore the
    temperature (log_softmax(logits) at T=1). Greedy requests (temperature 0) report
    log_softmax(logits), again matching the definition.
    """

    def __init__(self, base_model: str, max_lora_rank: int = 64, **engine_kwargs: Any) -> None:
        import vllm

        from stages.policy.model import resolve_model

        self.llm = vllm.LLM(
            model=resolve_model(base_model),
            enable_lora=True,
            max_lora_rank=max_lora_rank,
            logprobs_mode="processed_logprobs",
            **engine_kwargs,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.eos_ids = {self.tokenizer.eos_token_id}
        self._lora_ids: dict[str, int] = {}  # policy id -> vLLM's integer adapter id (must be > 0)
        self._lora_request: Any = None  # None: the base model

    def use_adapter(self, policy_id: str, adapter_dir: str | None) -> None:
        """Generate with this policy's LoRA adapter from now on (None: the base model)."""
        from vllm.lora.request import LoRARequest

        if adapter_dir is None:
            self._lora_request = None
            return
        lora_id = self._lora_ids.setdefault(policy_id, len(self._lora_ids) + 1)
        self._lora_request = LoRARequest(policy_id, lora_id, adapter_dir)

    def generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingConfig, seed: int | None = None
    ) -> list[Sample]:
        """Sample one turn per prompt; request i is seeded with seed + i, so identical prompts (a
        GRPO group) get different samples and each request is reproducible on its own."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if sampling.top_p < 1.0:
            raise ValueError("VLLMBackend records log-probs of the untruncated distribution only: use top_p=1.0")
        base = sampling.seed if seed is None else seed
        params = [
            SamplingParams(
                temperature=sampling.temperature,
                top_p=1.0,
                max_tokens=sampling.max_new_tokens,
                stop=list(sampling.stop) or None,
                include_stop_str_in_output=True,  # keep the text consistent with the tokens
                seed=base + i,
                logprobs=0,  # only the sampled token's log-prob
            )
            for i in range(len(prompt_token_ids))
        ]
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_token_ids]
        outputs = self.llm.generate(prompts, params, lora_request=self._lora_request, use_tqdm=False)
        samples = []
        for out in outputs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            lps = [step[t].logprob for step, t in zip(c.logprobs, ids)]  # one {token: Logprob} per step
            text = decode_turn(self.tokenizer, ids, self.eos_ids)
            samples.append(Sample(ids, lps, text, "stop" if c.finish_reason == "stop" else "length"))
        return samples
