"""vLLM's CPU LoRA products, computed per adapter instead of per token (installed by `install()` on a CPU engine).

vLLM 0.32 applies LoRA on the CPU with PyTorch ops (`vllm.lora.ops.torch_ops.lora_ops`, used by
`PunicaWrapperCPU`): each `bgmv_*` gathers a copy of the adapter's matrix for every token,
`lora_weights[indices]` of shape (T, out, in), then multiplies token by token (`einsum("bi, boi -> bo")`).
A prefill of 64 prompts of ~40 tokens copies ~100 MB per projection and layer; measured here, generation with a
rank-16 adapter of SmolLM2-135M ran at a fraction of the base model's speed (docs/BENCHMARKS.md, "vLLM on CPU").

The same products grouped by adapter are one matmul per adapter in the batch: `inputs[rows] @ W[u].T` for each
distinct index u (rlops' generate calls use one adapter each, so one matmul). The result is the same up to float
summation order (tests/stages/policy/test_vllm_cpu_lora.py compares it with vLLM's own functions, every index
including vLLM's -1); the index handling, the slicing and `add_inputs` are vLLM's, unchanged. `sgmv_*` (prefill)
call the `bgmv_*` of their module, so replacing the three `bgmv_*` there and in `punica_cpu`, which imported them
by name, covers every path. torch and vllm are imported inside the functions.
"""

from __future__ import annotations

from typing import Any

_installed = False


def _grouped(inputs: Any, weights: Any, indices: Any, dtype: Any) -> Any:
    """(T, out): row t = weights[indices[t]] @ inputs[t], one matmul per distinct index. (T, in) inputs,
    (L, [1,] out, in) weights, (T,) indices."""
    import torch

    if weights.dim() == 4:
        weights = weights.squeeze(dim=1)  # (L, out, in)
    inputs = inputs.to(dtype=dtype)
    uniques = torch.unique(indices)
    if uniques.numel() == 1:  # the common case: one adapter for the whole batch
        return inputs @ weights[uniques[0]].to(dtype=dtype).T
    out = inputs.new_empty((inputs.shape[0], weights.shape[1]))
    for u in uniques:
        rows = indices == u
        out[rows] = inputs[rows] @ weights[u].to(dtype=dtype).T
    return out


def bgmv_shrink(inputs: Any, lora_b_weights: Any, output_tensor: Any, lora_indices_tensor: Any,
                scaling: float = 1.0) -> None:
    """vLLM's `bgmv_shrink`, grouped by adapter."""
    outputs = _grouped(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs[:]


def bgmv_expand(inputs: Any, lora_b_weights: Any, output_tensor: Any, lora_indices_tensor: Any,
                add_inputs: bool = True) -> None:
    """vLLM's `bgmv_expand`, grouped by adapter."""
    outputs = _grouped(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common_len = min(outputs.shape[1], output_tensor.shape[1])  # adapter and model may pad differently
    if add_inputs:
        output_tensor[:, :common_len] += outputs[:limit, :common_len]
    else:
        output_tensor[:, :common_len] = outputs[:limit, :common_len]


def bgmv_expand_slice(inputs: Any, lora_b_weights: Any, output_tensor: Any, lora_indices_tensor: Any,
                      slice_offset: int, slice_size: int, add_inputs: bool = True) -> None:
    """vLLM's `bgmv_expand_slice`, grouped by adapter."""
    outputs = _grouped(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs[:]
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs[:]


def install() -> None:
    """Replace vLLM's three per-token CPU LoRA products with these (once per process)."""
    global _installed
    if _installed:
        return
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for module in (lora_ops, punica_cpu):
        module.bgmv_shrink, module.bgmv_expand, module.bgmv_expand_slice = bgmv_shrink, bgmv_expand, bgmv_expand_slice
    _installed = True
