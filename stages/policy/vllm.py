"""The vLLM generation backend (GPU, LoRA adapters hot-loaded per policy id) and a run's resident engine.

    backend = resident_vllm(base_model)     # the first call builds the engine; later calls reuse it
    with engines_asleep():                  # vLLM sleep mode level 1: weights to CPU RAM, KV cache freed
        train(...)                          # the GPU memory is the trainer's meanwhile

The resident engine is created once per run (per process and base model), reused by every rollout and
evaluation of the run, with LoRA adapters hot-swapped per policy id, and asleep while GRPO trains on the
same GPU. A run is one process (`rlops run`), so the engine lives in this module for the process's
lifetime: building it (loading weights, profiling memory, CUDA graphs) costs tens of seconds, far more
than a small rollout step. Adapters change every step and are loaded by vLLM per request
(`LoRARequest`); the base weights never change, so sleep level 1 (keep them in CPU memory) is enough.

vllm is imported inside the functions. Unverified: no GPU has run this module yet (README, "GPU").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from stages.policy.sampling import Constraint, RowOptions, Sample, SamplingConfig, decode_turn


class VLLMBackend:
    """vLLM on a GPU, one engine per base model, LoRA adapters hot-loaded per policy id.

    Log-probs: the engine runs with `logprobs_mode="processed_logprobs"`, i.e. log_softmax of the
    logits after temperature scaling (and after top-k/top-p masking). With top_p == 1 that is
    exactly log_softmax(logits / T), the definition in stages/policy/sampling.py, so `generate` refuses top_p < 1 rather
    than record nucleus-renormalised values. The default "raw_logprobs" would ignore the
    temperature (log_softmax(logits) at T=1). Greedy requests (temperature 0) report
    log_softmax(logits), again matching the definition.

    Constraints (`RowOptions.constraint`) go to vLLM's structured outputs as a grammar, on the
    "guidance" backend: the same llguidance and the same Lark text as the HF backend
    (stages/policy/constrain.py). vLLM applies the grammar bitmask to the logits before its sampler,
    so the processed log-probs are those of the masked distribution, as on HF. Top log-probs are
    vLLM's `logprobs=k` (the k best of the same processed distribution, plus the sampled token).
    Unverified: written against vLLM's documented API (>= 0.12 `StructuredOutputsParams`, 0.10-0.11
    `GuidedDecodingParams`), never run here.
    """

    def __init__(self, base_model: str, max_lora_rank: int = 64, **engine_kwargs: Any) -> None:
        import vllm

        from stages.policy.model import resolve_model

        self.llm = vllm.LLM(
            model=resolve_model(base_model),
            enable_lora=True,
            max_lora_rank=max_lora_rank,
            logprobs_mode="processed_logprobs",
            **_guidance_backend(),
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

    @property
    def lora_request(self) -> Any:
        """The LoRARequest requests are generated with (None: the base model): `use_adapter`'s choice."""
        return self._lora_request

    def generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingConfig, seed: int | None = None,
        rows: list[RowOptions] | None = None,
    ) -> list[Sample]:
        """Sample one turn per prompt; request i is seeded with seed + i, so identical prompts (a
        GRPO group) get different samples and each request is reproducible on its own. `rows[i]`:
        prompt i's top log-probs and constraint."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if sampling.top_p < 1.0:
            raise ValueError("VLLMBackend records log-probs of the untruncated distribution only: use top_p=1.0")
        base = sampling.seed if seed is None else seed
        rows = rows or [RowOptions()] * len(prompt_token_ids)
        params = [
            SamplingParams(
                temperature=sampling.temperature,
                top_p=1.0,
                max_tokens=sampling.max_new_tokens,
                stop=list(sampling.stop) or None,
                include_stop_str_in_output=True,  # keep the text consistent with the tokens
                seed=base + i,
                logprobs=row.top_logprobs,  # 0: only the sampled token's log-prob
                **_structured(row.constraint),
            )
            for i, row in enumerate(rows)
        ]
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_token_ids]
        outputs = self.llm.generate(prompts, params, lora_request=self._lora_request, use_tqdm=False)
        samples = []
        for out, row in zip(outputs, rows):
            c = out.outputs[0]
            ids = list(c.token_ids)
            lps = [step[t].logprob for step, t in zip(c.logprobs, ids)]  # one {token: Logprob} per step
            text = decode_turn(self.tokenizer, ids, self.eos_ids)
            sample = Sample(ids, lps, text, "stop" if c.finish_reason == "stop" else "length")
            if row.top_logprobs:
                # Each step's dict holds the k best (rank 1..k) and the sampled token (any rank); tokens
                # a constraint forbids (-inf) are left out, as on HF.
                sample.top_logprobs = [
                    [(t, lp.logprob) for t, lp in sorted(step.items(), key=lambda kv: kv[1].rank)
                     if lp.rank <= row.top_logprobs and lp.logprob != float("-inf")]
                    for step in c.logprobs]
            if row.constraint is not None:
                sample.constraint = row.constraint.label
            samples.append(sample)
        return samples


def _guidance_backend() -> dict[str, Any]:
    """The engine argument that makes llguidance vLLM's structured-output backend."""
    try:
        from vllm.sampling_params import StructuredOutputsParams  # noqa: F401  (vLLM >= 0.11)
    except ImportError:
        return {"guided_decoding_backend": "guidance"}
    return {"structured_outputs_config": {"backend": "guidance"}}


def _structured(constraint: Constraint | None) -> dict[str, Any]:
    """SamplingParams' keyword for a row's constraint: the Lark grammar (llguidance's dialect, which
    the guidance backend reads as is); nothing for a free row."""
    if constraint is None:
        return {}
    try:
        from vllm.sampling_params import StructuredOutputsParams
    except ImportError:
        from vllm.sampling_params import GuidedDecodingParams

        return {"guided_decoding": GuidedDecodingParams(grammar=constraint.lark, backend="guidance")}
    return {"structured_outputs": StructuredOutputsParams(grammar=constraint.lark)}


_RESIDENT: dict[str, VLLMBackend] = {}  # base model -> its engine, for this process's run


def resident_vllm(base_model: str) -> VLLMBackend:
    """This process's vLLM engine for `base_model`, built on first use with sleep mode enabled."""
    if base_model not in _RESIDENT:
        _RESIDENT[base_model] = VLLMBackend(base_model, enable_sleep_mode=True)
    return _RESIDENT[base_model]


@contextmanager
def engines_asleep() -> Iterator[None]:
    """Put every resident engine to sleep (level 1) for the block, and wake them after it."""
    engines = list(_RESIDENT.values())
    for e in engines:
        e.llm.sleep(level=1)
    try:
        yield
    finally:
        for e in engines:
            e.llm.wake_up()
