"""The resident policy: base weights loaded once, LoRA adapters hot-loaded by policy id.

    policy = ResidentPolicy.load("SmolLM2-135M-Instruct")
    samples = policy.generate("ck-123", "/ws/checkpoints/ck-123", prompts, sampling, seed=7)

Serving many checkpoints of one base model (the policy service, a chained run's rollout and eval)
then costs one base model in memory plus a few MB per adapter, and a new checkpoint is usable as
soon as its adapter folder exists: nothing restarts. On the `hf` engine the adapters are peft
adapters inside one `PeftModel` (`load_adapter` / `set_adapter`; the base is served with the
adapters disabled), at most `max_adapters` kept, least recently used evicted. On the `vllm`
engine vLLM loads them itself (`VLLMBackend.use_adapter`), on the process's one resident engine.

Generation is serialised by a lock: the active adapter is model state, so two callers must not
switch it under each other. Callers that want throughput batch their prompts first (the policy
service does). torch/transformers/peft/vllm are imported inside the functions.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from contextlib import nullcontext
from typing import Any, Callable, Literal

from stages.policy.sampling import RowOptions, Sample, SamplingConfig

Engine = Literal["hf", "vllm"]


class ResidentPolicy:
    """One base model in memory serving its LoRA adapters by policy id (see the module docstring)."""

    def __init__(self, backend: Any, tokenizer: Any, engine: Engine = "hf", max_adapters: int = 8) -> None:
        self.backend = backend  # HFBackend or VLLMBackend
        self.tokenizer = tokenizer
        self.engine = engine
        self.max_adapters = max_adapters  # each LoRA adapter of SmolLM2 (r=16, attention) is ~3.5 MB
        self.eos_ids: set[int] = backend.eos_ids
        self._adapters: OrderedDict[str, str] = OrderedDict()  # peft adapter name -> folder, LRU order
        self._loads = 0  # adapters loaded so far: names them uniquely
        self._lock = threading.Lock()

    @classmethod
    def load(cls, base_model: str, engine: Engine = "hf", max_adapters: int = 8) -> "ResidentPolicy":
        """Load the base model once (fp32 on CPU, bf16 on CUDA, as `load_policy`) in eval mode."""
        if engine == "vllm":
            from stages.policy.vllm import resident_vllm

            backend = resident_vllm(base_model)  # the process's engine: a run's rollouts and its agents' share it
            return cls(backend, backend.tokenizer, engine, max_adapters)
        from stages.policy.hf import HFBackend
        from stages.policy.load import load_policy

        model, tokenizer = load_policy(base_model)
        return cls(HFBackend(model, tokenizer), tokenizer, engine, max_adapters)

    @property
    def max_context(self) -> int:
        """The longest sequence (prompt + completion) the model takes."""
        if self.engine == "vllm":
            return int(self.backend.llm.llm_engine.model_config.max_model_len)
        return int(self.backend.model.config.max_position_embeddings)

    def generate(self, policy_id: str, adapter_dir: str | None, prompt_token_ids: list[list[int]],
                 sampling: SamplingConfig, seed: int | None = None, rows: list[RowOptions] | None = None,
                 on_step: Callable[[list[int]], None] | None = None) -> list[Sample]:
        """Sample one continuation per prompt from `policy_id` (its adapter folder, None for the base);
        `rows[i]`: prompt i's top log-probs and constraint (None: nothing asked). `on_step` receives each
        decoding step's tokens (one per row) as the HF backend samples them; vLLM's offline engine returns
        whole turns, so there it is not called (a streamed request then gets its tokens at the end of the
        turn)."""
        with self._lock:
            if self.engine == "vllm":
                self.backend.use_adapter(policy_id, adapter_dir)
                return self.backend.generate(prompt_token_ids, sampling, seed, rows)
            with self._activate(adapter_dir):
                return self.backend.generate(prompt_token_ids, sampling, seed, rows, on_step=on_step)

    def _activate(self, adapter_dir: str | None) -> Any:
        """Make `adapter_dir` the active peft adapter (loading it on first use); returns the context
        to generate in (the adapters disabled, for the base model)."""
        model = self.backend.model
        if adapter_dir is None:
            return model.disable_adapter() if hasattr(model, "peft_config") else nullcontext()
        # Adapter folders are immutable (a checkpoint id names its content), so the folder is the key.
        name = next((n for n, d in self._adapters.items() if d == adapter_dir), None)
        if name is None:
            name = f"adapter{self._loads}"
            self._loads += 1
            self._load(adapter_dir, name)
        self._adapters.move_to_end(name)
        self.backend.model.set_adapter(name)
        return nullcontext()

    def _load(self, adapter_dir: str, name: str) -> None:
        from peft import PeftModel

        model = self.backend.model
        if not hasattr(model, "peft_config"):
            model = PeftModel.from_pretrained(model, adapter_dir, adapter_name=name, is_trainable=False)
        else:
            model.load_adapter(adapter_dir, adapter_name=name, is_trainable=False)
            if len(self._adapters) >= self.max_adapters:
                oldest = next(iter(self._adapters))
                model.delete_adapter(oldest)
                del self._adapters[oldest]
        # eval(): LoRA dropout off, so sampling and the recorded log-probs follow the policy exactly.
        model.eval()
        self.backend.model = model
        self._adapters[name] = adapter_dir
