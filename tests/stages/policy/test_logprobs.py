"""Chunked, selected-rows log-probs against the naive full-softmax reference, on a tiny Llama."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from stages.policy import logprobs
from stages.policy.logprobs import token_logprobs

PAD = 0


def sequence_logprobs_reference(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Naive full-softmax version of token_logprobs (positions_mask=None), the reference the chunked
    one is checked against: builds the whole (B, T, V) float32 log-softmax."""
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=logprobs._position_ids(attention_mask),
        use_cache=False,
    ).logits.float() / temperature  # (B, T, V)
    logp = logits[:, :-1].log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    want = logprobs._scored_positions(attention_mask, None)
    return torch.where(want, torch.nn.functional.pad(logp, (1, 0)), 0.0)  # (B, T)


LENGTHS = [10, 7, 4]  # left-padded to T = 10: 9 + 6 + 3 = 18 scored rows, so chunk_size 5 -> 4 chunks


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
        pad_token_id=PAD,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    T = max(LENGTHS)
    input_ids = torch.full((len(LENGTHS), T), PAD)
    attention_mask = torch.zeros(len(LENGTHS), T, dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        input_ids[i, T - n :] = torch.randint(1, 256, (n,), generator=gen)
        attention_mask[i, T - n :] = 1
    return input_ids, attention_mask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_full_softmax_reference(model, batch, temperature: float) -> None:
    input_ids, attention_mask = batch
    with torch.no_grad():
        got = token_logprobs(model, input_ids, attention_mask, temperature=temperature, chunk_size=5)
        ref = sequence_logprobs_reference(model, input_ids, attention_mask, temperature)
    assert got.shape == input_ids.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # zero at t = 0, on padding, and on each row's first real token (its predecessor is padding)
    scored = torch.zeros_like(attention_mask, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        scored[i, input_ids.shape[1] - n + 1 :] = True
    assert torch.all(got[~scored] == 0) and torch.all(got[scored] < 0)


def test_positions_mask_selects_rows(model, batch) -> None:
    input_ids, attention_mask = batch
    positions = torch.zeros_like(attention_mask, dtype=torch.bool)
    positions[:, -3:] = True  # e.g. the loss_mask of a short completion
    positions[2, 0] = True  # a padding position: ignored
    with torch.no_grad():
        got = token_logprobs(model, input_ids, attention_mask, positions, chunk_size=2)
        ref = sequence_logprobs_reference(model, input_ids, attention_mask)
    torch.testing.assert_close(got, torch.where(positions & attention_mask.bool(), ref, 0.0), atol=1e-5, rtol=1e-5)


def test_left_padding_matches_unpadded_row(model, batch) -> None:
    # padding is masked out, and position ids count real tokens only (as generate() does)
    input_ids, attention_mask = batch
    start = input_ids.shape[1] - LENGTHS[1]
    with torch.no_grad():
        padded = token_logprobs(model, input_ids, attention_mask)[1, start:]
        alone = token_logprobs(model, input_ids[1:2, start:], attention_mask[1:2, start:])[0]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)


def test_peft_lora_model_matches_reference_and_trains(model, batch) -> None:
    input_ids, attention_mask = batch
    torch.manual_seed(2)
    lora = get_peft_model(
        copy.deepcopy(model),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False),
    )
    with torch.no_grad():
        base = token_logprobs(model, input_ids, attention_mask, temperature=0.7)
        ref = sequence_logprobs_reference(lora, input_ids, attention_mask, 0.7)
    got = token_logprobs(lora, input_ids, attention_mask, temperature=0.7, chunk_size=5)
    torch.testing.assert_close(got.detach(), ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got.detach(), base, atol=1e-3)  # the adapter changes the outputs

    lora_params = {n: p for n, p in lora.named_parameters() if p.requires_grad}
    assert lora_params and all("lora_" in n for n in lora_params)
    assert any("lm_head" in n for n in lora_params)  # LoRA on the output layer is reached too
    got.sum().backward()  # through the per-chunk recomputation (activation checkpointing)
    grads = {n: p.grad.clone() for n, p in lora_params.items()}
    assert all(g.abs().sum() > 0 for g in grads.values())
    lora.zero_grad()
    sequence_logprobs_reference(lora, input_ids, attention_mask, 0.7).sum().backward()
    for n, p in lora_params.items():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-5, rtol=1e-4)
