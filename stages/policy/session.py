"""The resident policy of a chained run: base weights loaded once per process, LoRA weights swapped in memory.

    with PolicySession() as session:                      # flows.pipeline opens one per run
        ctx = replace(ctx, session=session)
        rollout.run(..., ctx)    # generates with the session's model, the policy's adapter active
        grpo.run(..., ctx)       # trains that same model's adapter, writes the checkpoint as always,
        rollout.run(..., ctx)    # and the next rollout uses the trained weights already in memory

A stage called without a session (`rlops stage ...`) loads its model from files, as before. Both paths
compute the same thing, so artifact ids and results do not depend on it (tests/flows/test_resident.py):

- generation and training share one base model per (model, dtype, device): fp32 on CPU for both; on
  CUDA generation runs bf16 and the update fp32, so there are two, each still loaded once;
- a base holds at most one peft LoRA adapter (`default`). Activating a policy copies its LoRA weights
  into it: from memory when this process trained them, else from the checkpoint's safetensors. An
  adapter with another LoRA shape (rank, targets) replaces the current one (`unload`, then a fresh
  wrapper); a fresh adapter for a GRPO step from the base is initialised exactly as `stages.policy.lora.add_lora`
  does (same seed), so it equals the file path's;
- the base policy generates with the adapter disabled, which computes exactly the bare model;
- dropout is off everywhere (eval mode for generation, `stages.update.train._train_without_dropout` for updates);
- Ray rollout actors live as long as the session and receive each policy's LoRA weights through the
  object store instead of reloading the model (`stages.rollout`).

A session is used by one stage at a time (the pipeline is sequential). torch/peft are imported inside
the functions.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

from storage.checkpoints import local_copy

AdapterState = dict[str, Any]  # peft LoRA weights (as `get_peft_model_state_dict` gives them), on CPU


@dataclass
class _Trained:
    """LoRA weights this process trained, kept so the policy can be activated without reading its files."""

    config: Any  # peft LoraConfig
    state: AdapterState


def _shape_key(config: Any) -> tuple:
    """What makes two LoRA configs hold interchangeable weights in one adapter slot (dropout included:
    it is saved into the checkpoint's adapter_config.json, which must not depend on the path taken)."""
    return (config.r, config.lora_alpha, config.lora_dropout, tuple(sorted(config.target_modules or ())),
            config.bias, bool(getattr(config, "use_rslora", False)), bool(getattr(config, "use_dora", False)))


class ResidentModel:
    """One base model in memory and the policy whose LoRA weights its adapter holds now."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model  # the bare transformers model, or a PeftModel wrapping it with one `default` adapter
        self.tokenizer = tokenizer
        self.current: str | None = None  # policy id whose weights are in the adapter (None: unknown/fresh)
        self.copies = {"memory": 0, "files": 0}  # adapter activations that copied weights, by source

    @property
    def wrapped(self) -> bool:
        return hasattr(self.model, "peft_config")

    def activate(self, policy_id: str, adapter_dir: str | None, trained: _Trained | None = None) -> Any:
        """Make `policy_id` the active policy; returns the context to run it in (the adapter disabled
        for the base policy, `adapter_dir` None). Eval mode: no dropout."""
        self.model.eval()
        if adapter_dir is None:
            return self.model.disable_adapter() if self.wrapped else nullcontext()
        if self.current != policy_id:
            self._load(policy_id, adapter_dir, trained)
        return nullcontext()

    def _load(self, policy_id: str, adapter_dir: str, trained: _Trained | None) -> None:
        from peft import LoraConfig, load_peft_weights, set_peft_model_state_dict

        self.current = None  # until the copy below is complete
        if trained is not None:
            config, state = trained.config, trained.state
        else:
            folder = local_copy(adapter_dir)
            config, state = LoraConfig.from_pretrained(folder), load_peft_weights(folder, device="cpu")
        self._shape(config)
        result = set_peft_model_state_dict(self.model, state)
        if result.unexpected_keys:
            raise ValueError(f"adapter of {policy_id} has weights the model does not: {result.unexpected_keys[:3]}")
        self.model.eval()
        self.current = policy_id
        self.copies["memory" if trained is not None else "files"] += 1

    def _shape(self, config: Any) -> None:
        """Give the model one adapter of `config`'s shape (keeping the current one when it matches)."""
        import torch
        from peft import get_peft_model

        if self.wrapped and _shape_key(self.model.peft_config["default"]) == _shape_key(config):
            return
        bare = self.model.unload() if self.wrapped else self.model  # drops the LoRA layers, no merge
        with torch.random.fork_rng(devices=[]):  # the fresh weights are overwritten: leave the RNG alone
            self.model = get_peft_model(bare, copy.deepcopy(config))  # peft edits the config it is given

    def fresh(self, lora: Any) -> None:
        """A new adapter initialised exactly as `stages.policy.lora.add_lora` initialises one on a bare model."""
        from stages.policy.lora import add_lora

        self.current = None
        bare = self.model.unload() if self.wrapped else self.model
        self.model = add_lora(bare, lora)

    def trainable(self) -> Any:
        """The model with its adapter's weights requiring grad (and nothing else), for an update."""
        for name, p in self.model.named_parameters():
            p.requires_grad_("lora_" in name)
        return self.model

    def settle(self, policy_id: str | None) -> None:
        """After an update: the adapter now holds `policy_id` (None: an update that failed midway)."""
        from stages.policy.logprobs import set_activation_checkpointing

        set_activation_checkpointing(self.model, False)
        for p in self.model.parameters():
            p.requires_grad_(False)
            p.grad = None
        self.model.eval()
        self.current = policy_id


@dataclass
class PolicySession:
    """Resident models, trained adapter weights and rollout actors of one run (see the module docstring)."""

    max_trained: int = 4  # trained adapters kept in memory (~3.5 MB each for SmolLM2, r=16, attention)
    models: dict[tuple, ResidentModel] = field(default_factory=dict)
    trained: OrderedDict[str, _Trained] = field(default_factory=OrderedDict)
    kept: dict[Any, Any] = field(default_factory=dict)  # rollout workers and actor pools, by what they were built for
    _closers: list[Callable[[], None]] = field(default_factory=list)

    def model(self, base_model: str, training: bool = False) -> ResidentModel:
        """The resident model for `base_model`: as `stages.policy.load.load_policy` loads it for generation,
        or in fp32 for an update (the same one on CPU)."""
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = "float32" if training or device == "cpu" else "bfloat16"
        key = (base_model, device, dtype)
        if key not in self.models:
            from stages.policy.load import load_policy

            model, tokenizer = load_policy(base_model, device=device, dtype=dtype)
            self.models[key] = ResidentModel(model, tokenizer)
        return self.models[key]

    def generation(self, base_model: str, policy_id: str, adapter_dir: str | None) -> tuple[ResidentModel, Any]:
        """(resident model, context to generate in) with `policy_id` active."""
        resident = self.model(base_model)
        return resident, resident.activate(policy_id, adapter_dir, self.trained.get(policy_id))

    def for_update(self, base_model: str, parent_id: str, adapter_dir: str | None, lora: Any) -> ResidentModel:
        """The resident fp32 model holding `parent_id`'s adapter (a fresh `lora` one when the parent has
        none), ready to train; call `updated` (or `settle(None)` on failure) afterwards."""
        resident = self.model(base_model, training=True)
        if adapter_dir is None:
            resident.fresh(lora)
        else:
            resident.activate(parent_id, adapter_dir, self.trained.get(parent_id))
        resident.current = None  # the weights are about to change
        resident.trainable()
        return resident

    def updated(self, resident: ResidentModel, policy_id: str) -> None:
        """Record that `resident`'s adapter now holds `policy_id` (its checkpoint is written)."""
        from peft import get_peft_model_state_dict

        state = {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(resident.model).items()}
        self.trained[policy_id] = _Trained(copy.deepcopy(resident.model.peft_config["default"]), state)
        while len(self.trained) > self.max_trained:
            self.trained.popitem(last=False)
        resident.settle(policy_id)

    def stats(self) -> dict[str, int]:
        """Models loaded, and adapter weight copies from memory and from files, so far."""
        return {"models": len(self.models), **{f"adapters_from_{k}": sum(m.copies[k] for m in self.models.values())
                                                for k in ("memory", "files")}}

    def keep(self, key: Any, build: Callable[[], Any]) -> Any:
        """The object kept under `key`, built on first use (rollout workers, Ray actor pools)."""
        if key not in self.kept:
            self.kept[key] = build()
        return self.kept[key]

    def on_close(self, fn: Callable[[], None]) -> None:
        self._closers.append(fn)

    def close(self) -> None:
        """Stop the rollout actors and drop the models."""
        for fn in reversed(self._closers):
            fn()
        self._closers.clear()
        self.kept.clear()
        self.models.clear()
        self.trained.clear()

    def __enter__(self) -> PolicySession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
