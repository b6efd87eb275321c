"""The resident vLLM engine: created once per run (per process and base model), reused by every
rollout and evaluation of the run, with LoRA adapters hot-swapped per policy id; asleep while GRPO
trains on the same GPU.

    backend = resident_vllm(base_model)     # the first call builds the engine; later calls reuse it
    with engines_asleep():                  # vLLM sleep mode level 1: weights to CPU RAM, KV cache freed
        train(...)                          # the GPU memory is the trainer's meanwhile

A run is one process (`rlops run`), so the engine lives in this module for the process's lifetime:
building it (loading weights, profiling memory, CUDA graphs) costs tens of seconds, far more than a
small rollout step. Adapters change every step and are loaded by vLLM per request (`LoRARequest`);
the base weights never change, so sleep level 1 (keep them in CPU memory) is enough.

Unverified: no GPU has run this module yet (README, "GPU").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stages.policy.generate import VLLMBackend

_RESIDENT: dict[str, VLLMBackend] = {}  # base model -> its engine, for this process's run


def resident_vllm(base_model: str) -> VLLMBackend:
    """This process's vLLM engine for `base_model`, built on first use with sleep mode enabled."""
    if base_model not in _RESIDENT:
        from stages.policy.generate import VLLMBackend

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
