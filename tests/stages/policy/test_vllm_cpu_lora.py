"""vLLM's CPU LoRA products grouped per adapter (stages/policy/vllm_cpu_lora.py) equal vLLM's per-token definition:
row t of the result is weights[indices[t]] applied to inputs[t], whatever the mix of indices (vLLM's -1 included),
with vLLM's scaling, slicing, padding and add_inputs."""

from __future__ import annotations

import pytest
import torch

from stages.policy import vllm_cpu_lora as ops


def _per_token(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """vLLM 0.32's torch_ops: a gathered copy of the matrix per token, multiplied token by token."""
    selected = w[idx]
    if selected.dim() == 4:
        selected = selected.squeeze(dim=1)
    return torch.einsum("bi, boi -> bo", x, selected)


@pytest.mark.parametrize("indices", [[0] * 7, [1, 0, 1, 1, -1, 0, 2], [-1] * 7])
@pytest.mark.parametrize("stacked", [3, 4])  # vLLM stacks adapters as (L, out, in) or (L, 1, out, in)
def test_grouped_products_equal_the_per_token_ones(indices: list[int], stacked: int) -> None:
    gen = torch.Generator().manual_seed(0)
    idx = torch.tensor(indices)
    x = torch.randn(7, 12, generator=gen)
    a = torch.randn(3, 4, 12, generator=gen)  # shrink: 12 -> rank 4
    b = torch.randn(3, 10, 4, generator=gen)  # expand: rank 4 -> 10
    if stacked == 4:
        a, b = a.unsqueeze(1), b.unsqueeze(1)

    y = torch.zeros(7, 4)
    ops.bgmv_shrink(x, a, y, idx, scaling=0.5)
    assert torch.allclose(y, 0.5 * _per_token(x, a, idx), atol=1e-5)

    h = torch.randn(7, 4, generator=gen)
    base = torch.randn(7, 10, generator=gen)
    out = base.clone()
    ops.bgmv_expand(h, b, out, idx, add_inputs=True)
    assert torch.allclose(out, base + _per_token(h, b, idx), atol=1e-5)
    padded = torch.zeros(7, 8)  # the model pads less than the adapter: the common columns only
    ops.bgmv_expand(h, b, padded, idx, add_inputs=False)
    assert torch.allclose(padded, _per_token(h, b, idx)[:, :8], atol=1e-5)

    fused = base.clone()
    ops.bgmv_expand_slice(h[:, :4], b[..., :4, :], fused, idx, 3, 4, add_inputs=True)
    want = base.clone()
    want[:, 3:7] += _per_token(h, b[..., :4, :], idx)
    assert torch.allclose(fused, want, atol=1e-5)
