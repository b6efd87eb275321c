"""The resident policy of a chained run: base weights loaded once per process, LoRA weights swapped in memory.

    with PolicySession() as session:                      # flows.pipeline opens one per run
        ctx = replace(ctx, session=session)
        rollout.run(..., ctx)    # generates with the session's model, the policy's adapter active
        grpo.run(..., ctx)       # trains that same model's adapter, writes the checkpoint as always,
        rollout.run(..., ctx)    # and the next rollout uses the trained weights already in memory

A stage called without a session (`rlops stage ...`) loads its model from files, as before. Both paths
compute the same thing, so artifact ids and results do not depend on it (tests/flows/test_resident.py):

- generation and training share one base model per (model, dtype, device): fp32 on CPU for both; on
  CUDA generation runs bf16 and the update fp32 (on a CPU too with `rollout.dtype: bfloat16`), so there are two,
  each still loaded once (one again when `grpo.dtype` is bfloat16 too: the LoRA weights stay fp32 on either);
- a base holds at most one peft LoRA adapter (`default`). Activating a policy copies its LoRA weights
  into it: from memory when this process trained them, else from the checkpoint's safetensors. An
  adapter with another LoRA shape (rank, targets) replaces the current one (`unload`, then a fresh
  wrapper); a fresh adapter for a GRPO step from the base is initialised exactly as `stages.policy.lora.add_lora`
  does (same seed), so it equals the file path's;
- the base policy generates with the adapter disabled, which computes exactly the bare model;
- dropout is off everywhere (eval mode for generation, `stages.update.train._train_without_dropout` for updates);
- Ray rollout actors live as long as the session and receive each policy's LoRA weights through the
  object store instead of reloading the model (`stages.rollout`): as the update's worker group returned them
  (`grpo.workers > 1`, stages/update/group.py), or put there once by this process; each arrives with the sha256
  of its content (`ShippedAdapter`), checked where it lands;
- the data-parallel update's worker group (`grpo.workers > 1`) is kept for the session too, and stopped with it.

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


def adapter_digest(state: AdapterState) -> str:
    """sha256 of LoRA weights' content: every tensor's name, dtype, shape and bytes, in name order."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())  # raw bytes whatever the dtype (bf16 included)
    return h.hexdigest()


@dataclass
class _Trained:
    """LoRA weights this process trained, kept so the policy can be activated without reading its files."""

    config: Any  # peft LoraConfig
    state: AdapterState
    shipped: ShippedAdapter | None = None  # the same weights in Ray's object store, once some actor needed them


@dataclass(frozen=True)
class ShippedAdapter:
    """LoRA weights in Ray's object store, for Ray actors: the object (`ref`, an AdapterState) and the sha256 of
    its content (`adapter_digest`), which `receive` checks where it arrives."""

    config: Any  # peft LoraConfig
    ref: Any  # ray.ObjectRef
    digest: str

    def receive(self, policy_id: str) -> _Trained:
        """The weights, fetched from the object store; RuntimeError when their content is not what was sent."""
        import ray

        state = ray.get(self.ref)
        got = adapter_digest(state)
        if got != self.digest:
            raise RuntimeError(f"the LoRA weights of {policy_id} arrived with sha256 {got[:16]}..., "
                               f"not the {self.digest[:16]}... they were sent with")
        return _Trained(self.config, state)


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
        from peft import LoraConfig, load_peft_weights

        self.current = None  # until the copy below is complete
        if trained is not None:
            config, state = trained.config, trained.state
        else:
            folder = local_copy(adapter_dir)
            config, state = LoraConfig.from_pretrained(folder), load_peft_weights(folder, device="cpu")
        unexpected = self.hold(config, state)
        if unexpected:
            raise ValueError(f"adapter of {policy_id} has weights the model does not: {unexpected[:3]}")
        self.model.eval()
        self.current = policy_id
        self.copies["memory" if trained is not None else "files"] += 1

    def hold(self, config: Any, state: AdapterState) -> list[str]:
        """Give the model one adapter of `config`'s shape holding `state`'s weights; returns the names in `state`
        the adapter has no weight for (nothing was copied for those)."""
        from peft import set_peft_model_state_dict

        self._shape(config)
        return list(set_peft_model_state_dict(self.model, state).unexpected_keys)

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
    kept: dict[Any, Any] = field(default_factory=dict)  # rollout workers, actor pools, update groups, by what they were built for
    _closers: list[Callable[[], None]] = field(default_factory=list)

    def model(self, base_model: str, training: bool = False, dtype: str | None = None) -> ResidentModel:
        """The resident model for `base_model`: as `stages.policy.load.load_policy` loads it for generation (in
        `dtype`, by default bf16 on CUDA and fp32 on CPU), or for an update (in `dtype`, by default fp32); one model
        for both when their dtypes agree."""
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        if training:
            dtype = dtype or "float32"
        else:
            dtype = dtype or ("float32" if device == "cpu" else "bfloat16")
        key = (base_model, device, dtype)
        if key not in self.models:
            from stages.policy.load import load_policy

            model, tokenizer = load_policy(base_model, device=device, dtype=dtype)
            self.models[key] = ResidentModel(model, tokenizer)
        return self.models[key]

    def generation(self, base_model: str, policy_id: str, adapter_dir: str | None,
                   dtype: str | None = None) -> tuple[ResidentModel, Any]:
        """(resident model, context to generate in) with `policy_id` active, its weights in `dtype` (`model`'s)."""
        resident = self.model(base_model, dtype=dtype)
        return resident, resident.activate(policy_id, adapter_dir, self.trained.get(policy_id))

    def for_update(self, base_model: str, parent_id: str, adapter_dir: str | None, lora: Any,
                   dtype: str | None = None) -> ResidentModel:
        """The resident model (base weights fp32, or `dtype`: `grpo.dtype`) holding `parent_id`'s adapter (a fresh
        `lora` one when the parent has none), ready to train; call `updated` (or `settle(None)` on failure) afterwards."""
        resident = self.model(base_model, training=True, dtype=dtype)
        if adapter_dir is None:
            resident.fresh(lora)
        else:
            resident.activate(parent_id, adapter_dir, self.trained.get(parent_id))
        resident.current = None  # the weights are about to change
        resident.trainable()
        return resident

    def updated(self, resident: ResidentModel, policy_id: str, stored: tuple[Any, str] | None = None) -> None:
        """Record that `resident`'s adapter now holds `policy_id` (its checkpoint is written). `stored`: (object
        ref, sha256) of the same weights already in Ray's object store (as the update's worker group returned
        them), what Ray rollout actors then receive; RuntimeError when the resident model's differ from them."""
        from peft import get_peft_model_state_dict

        state = {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(resident.model).items()}
        config = copy.deepcopy(resident.model.peft_config["default"])
        shipped = None
        if stored is not None:
            ref, digest = stored
            if adapter_digest(state) != digest:
                raise RuntimeError(f"the resident model's LoRA weights of {policy_id} differ from those the update "
                                   "workers returned")
            shipped = ShippedAdapter(config, ref, digest)
        self.trained[policy_id] = _Trained(config, state, shipped)
        while len(self.trained) > self.max_trained:
            self.trained.popitem(last=False)
        resident.settle(policy_id)

    def shipped(self, policy_id: str) -> ShippedAdapter | None:
        """`policy_id`'s LoRA weights in Ray's object store when this session holds them (put there once: the
        update workers' object, or this process's), for Ray actors; None when it does not hold them."""
        trained = self.trained.get(policy_id)
        if trained is None:
            return None
        if trained.shipped is None:
            import ray

            trained.shipped = ShippedAdapter(trained.config, ray.put(trained.state), adapter_digest(trained.state))
        return trained.shipped

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
        """Stop the rollout actors and the update workers, and drop the models."""
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
