"""The HF generation backend: batched sampling with transformers' `generate`, recording behaviour log-probs.

    backend = HFBackend(model, tokenizer)
    samples = backend.generate(prompt_token_ids, SamplingConfig(temperature=1.0), seed=7)

Left-padded batches, seeded, on CPU or GPU. Identical prompts in a batch are prefilled once, and so is the
common prefix of distinct ones (a system prompt shared by an evaluation's prompts); inside
`conversation()` an agent's next turn reuses its previous turn's key/value cache (stages/policy/kv_cache.py).
Two logits processors ride along with `generate` (stages/policy/processors.py): one records
log_softmax(logits / T) at each sampled token (the definition in stages/policy/sampling.py; and the top k
for rows that ask), one draws the token itself by inverse-CDF sampling. When a row is constrained
(`RowOptions.constraint`), a third runs first and masks each constrained row to its grammar
(stages/policy/constrain.py), so what is recorded is the masked distribution; calls without a
constrained row do not have it.

torch and transformers are imported inside the functions that need them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from stages.policy.kv_cache import KeptCache, cache_kwarg, growing
from stages.policy.processors import _InverseCDFSampler, _LogprobRecorder
from stages.policy.sampling import RowOptions, Sample, SamplingConfig, decode_turn, eos_token_ids

if TYPE_CHECKING:
    import torch

# The shortest common prefix of distinct prompts run once for all of them (`HFBackend._prefix_prefill`): below it the
# extra forward costs more than the columns it saves.
MIN_SHARED_PREFIX = 16


def _takes(model: Any, argument: str) -> bool:
    """Whether the forward of `model` (or of the transformers model inside a peft wrapper) takes `argument`."""
    import inspect

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return argument in inspect.signature(inner.forward).parameters


def _contiguous_head(model: Any) -> None:
    """Hand the output layer a contiguous input when the model computes in bf16/fp16 (once per model).

    generate's first step computes logits at the last position only: a (B, 1, d) slice of the (B, P, d) hidden states,
    not contiguous. torch's matmul then takes its batched path, and for bf16 on a CPU that copies the output weight
    once per row: (B, d, V) = 1.8 GB for 32 rows of SmolLM2, 5.6 GB for an evaluation's 100, ~7 s per call (measured;
    docs/BENCHMARKS.md). A contiguous copy of the slice costs B x d values and takes the plain matrix product. fp32 is
    left exactly as it was (its batched path copies nothing, and a different product would round differently)."""
    import torch

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)  # a quantized layer's is a method: left as it is
    if not isinstance(weight, torch.Tensor) or weight.dtype not in (torch.bfloat16, torch.float16) \
            or getattr(head, "_rlops_contiguous", False):
        return
    head.register_forward_pre_hook(lambda module, args: (args[0].contiguous(), *args[1:]))
    head._rlops_contiguous = True


class _StepStreamer:
    """transformers' streamer protocol, handing each decoding step's sampled tokens (one per row) to a
    callback: the policy service streams them to its clients while the batch is still generating.
    generate's first `put` is the prompt, skipped."""

    def __init__(self, on_step: Callable[[list[int]], None]) -> None:
        self.on_step = on_step
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.on_step(value.reshape(-1).tolist())  # (B,): rows that already finished get the pad id

    def end(self) -> None:
        pass


class HFBackend:
    """Batched sampling with `transformers`' `generate` (left padding, seeded, CPU or GPU)."""

    def __init__(self, model: Any, tokenizer: Any, share_prompts: bool = True, reuse_turns: bool = True,
                 share_prefix: bool = True) -> None:
        self.model = model
        self.tokenizer = tokenizer
        # Identical prompts in a batch (the G samples of a group, on their first turn) are prefilled once
        # and their key/value cache copied to every row that shares them (`_shared_prefill`).
        self.share_prompts = share_prompts
        # Inside `conversation()`, a prompt that extends a row of the previous call (an agent's next turn)
        # prefills only its new tokens (`_reuse_prefill`).
        self.reuse_turns = reuse_turns
        # Distinct prompts that begin alike (a shared system prompt) prefill that prefix once (`_prefix_prefill`).
        self.share_prefix = share_prefix
        self._kept: KeptCache | None = None
        # A prefill run for its key/value cache alone needs no logits but the last position's: without this, the output
        # layer ran on every prompt token (20 % of the parity config's prefill). The cache is the same either way.
        self._cache_only = {"logits_to_keep": 1} if _takes(model, "logits_to_keep") else {}
        _contiguous_head(model)
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)

    def generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingConfig, seed: int | None = None,
        rows: list[RowOptions] | None = None, on_step: Callable[[list[int]], None] | None = None,
        inputs: Callable[[torch.Tensor], dict[str, Any]] | None = None,
    ) -> list[Sample]:
        """Sample one turn per prompt in one left-padded batch; deterministic for a given seed.
        `rows[i]` asks prompt i's top log-probs and grammar constraint (stages/policy/sampling.py); a
        free row samples exactly as it would in a call without the others' options. `on_step`, if given,
        receives each decoding step's sampled tokens (one per row, as they are produced; a finished row
        gets the pad id), without changing what is sampled. `inputs`: more `generate` arguments made from
        the left-padded prompt ids (B, P) (a vision-language model's pixel tensors, the positions of its image
        tokens, suppressed tokens: stages/policy/vlm_resident.py); the shared prefill, which runs the model on
        the tokens alone, is then skipped."""
        import torch
        from transformers import LogitsProcessorList

        device = self.model.device
        width = max(len(ids) for ids in prompt_token_ids)
        input_ids = torch.full((len(prompt_token_ids), width), self.pad_id, dtype=torch.long)  # (B, P)
        attention_mask = torch.zeros_like(input_ids)  # (B, P), 0 on the left padding
        for row, ids in enumerate(prompt_token_ids):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention_mask[row, width - len(ids) :] = 1

        rows = rows or [RowOptions()] * len(prompt_token_ids)
        greedy = sampling.temperature == 0
        recorder = _LogprobRecorder(1.0 if greedy else sampling.temperature, [r.top_logprobs for r in rows])
        processors: list[Any] = [recorder]
        masker = None
        if any(r.constraint is not None for r in rows):  # free batches pay nothing for the feature
            from stages.policy.constrain import GrammarMasker

            # Before the recorder: the recorded log-probs are those of the masked distribution.
            masker = GrammarMasker([r.constraint for r in rows], self.tokenizer, self.eos_ids)
            processors.insert(0, masker)
        fast = not greedy and sampling.top_p >= 1.0  # sample in our processor, let generate take its pick
        if fast:
            processors.append(_InverseCDFSampler(sampling.temperature, recorder))
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
            kwargs.update(inputs(input_ids) if inputs is not None else {})
            keep = self._kept is not None
            cache = self._kept.prefill(prompt_token_ids, width) if keep else None
            if cache is None and self.share_prompts and not inputs:
                cache = self._shared_prefill(prompt_token_ids, input_ids, attention_mask)
            cache = growing(cache if cache is not None else self._empty_cache())
            if cache is not None:
                kwargs[cache_kwarg()] = cache
            if on_step is not None:
                kwargs["streamer"] = _StepStreamer(on_step)
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                      return_dict_in_generate=keep, **kwargs)
            sequences = out.sequences if keep else out  # (B, P + n)
            new = sequences[:, width:]  # (B, n)
            logprobs = recorder.finish(new[:, -1])  # (B, n)
        samples = [self._sample(ids, lps, sampling) for ids, lps in zip(new.tolist(), logprobs.tolist())]
        for i, (s, r) in enumerate(zip(samples, rows)):
            s.top_logprobs = recorder.top(i, r.top_logprobs, len(s.token_ids))
            if r.constraint is not None:
                s.constraint = r.constraint.label
                step, error = masker.errors.get(i, (None, None))
                if step is not None and step < len(s.token_ids):  # not after the row had ended anyway
                    s.error = f"constraint {r.constraint.label}: {error}"
        if keep:
            kept = [p + s.token_ids for p, s in zip(prompt_token_ids, samples)]
            self._kept.keep(kept, width, prompt_token_ids, getattr(out, cache_kwarg()))
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
        self._kept = KeptCache()
        try:
            yield
        finally:
            self._kept = None

    def _shared_prefill(self, prompts: list[list[int]], input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        """When rows repeat a prompt: run the distinct prompts (all but their last token) once and give
        every row a copy of its prompt's key/value cache (for `generate`, which then runs only the last
        prompt token per row). When every prompt is distinct but they begin alike (`_prefix_prefill`): their
        common prefix once. None when neither applies."""
        import torch

        first: dict[tuple[int, ...], int] = {}
        rows = [first.setdefault(tuple(ids), i) for i, ids in enumerate(prompts)]
        if len(first) == len(prompts):
            return self._prefix_prefill(prompts, input_ids.shape[1]) if self.share_prefix else None
        if input_ids.shape[1] < 2:
            return None
        distinct = torch.tensor(sorted(first.values()), device=input_ids.device)  # (U,) first row of each prompt
        slot = {row: k for k, row in enumerate(distinct.tolist())}
        ids, mask = input_ids[distinct, :-1], attention_mask[distinct, :-1]  # (U, P-1)
        # Left padding: positions count real tokens only, as generate computes them from the mask.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **self._cache_only)
        cache = getattr(out, cache_kwarg())
        cache.batch_select_indices(torch.tensor([slot[r] for r in rows], device=input_ids.device))  # (B, ...)
        return cache

    def _prefix_prefill(self, prompts: list[list[int]], width: int) -> Any:
        """Distinct prompts that begin with the same tokens (the system prompt, few-shot examples, a judge's
        instructions: an evaluation's 100 held-out prompts): run that prefix once, as a batch of one, and lay its
        keys and values into every row (`KeptCache.of_prefix`), so `generate` prefills only where the prompts
        differ. The same tokens and log-probs as a full prefill, up to float rounding. None when the common
        prefix is shorter than MIN_SHARED_PREFIX tokens (too little to be worth a forward of its own)."""
        import torch

        if len(prompts) < 2:
            return None
        n, shortest = 0, min(len(p) for p in prompts) - 1  # generate needs one prompt token per row
        head = prompts[0]
        while n < shortest and all(p[n] == head[n] for p in prompts):
            n += 1
        if n < MIN_SHARED_PREFIX:
            return None
        ids = torch.tensor([head[:n]], device=self.model.device)  # (1, n): positions 0..n-1, as in every row
        out = self.model(input_ids=ids, use_cache=True, **self._cache_only)
        kept = KeptCache.of_prefix(head[:n], getattr(out, cache_kwarg()))
        return None if kept is None else kept.prefill(prompts, width)

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
