"""The update's memory/speed settings change nothing but time: activation checkpointing off (the decoder's layers and
the output layer's chunks kept, not recomputed) and the entropy computed for the log only."""

from __future__ import annotations

import copy

import torch

from stages.update.train import train_on_batch
from tests.stages.test_grpo import G, LEARN, sample, tiny_setup


def test_checkpointing_off_and_a_logged_entropy_change_nothing_but_time() -> None:
    """Activation checkpointing off (the decoder's layers and the output layer's chunks kept, not recomputed) and the
    entropy computed for the log only (no backward through its softmax, entropy_coef 0) give the very same update,
    bit for bit, as checkpointing on with the entropy differentiated (entropy_coef 1e-30: nothing added)."""
    from stages.policy.logprobs import _chunk_logprobs
    from stages.update.loss import group_advantages

    model, _, prompts = tiny_setup(0)
    samples, rewards, groups = sample(model, prompts[:2], G, seed=0)
    advantages = group_advantages(torch.tensor(rewards), groups)
    params, entropies, head_calls = [], [], []
    for checkpointing, coef in ((True, 1e-30), (False, 0.0)):
        m = copy.deepcopy(model)
        chunks: list[bool] = []  # per output-layer chunk: run under torch.utils.checkpoint (recomputed in backward)?
        head = m.get_base_model().get_output_embeddings()
        hook = head.register_forward_hook(lambda mod, a, out: chunks.append(True))
        sgd = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=1.0)
        config = LEARN.model_copy(update={"activation_checkpointing": checkpointing, "entropy_coef": coef})
        entropies.append(train_on_batch(m, sgd, samples, advantages, config, temperature=1.0)[0]["entropy"])
        hook.remove()
        params.append(torch.cat([p.detach().flatten() for p in m.parameters() if p.requires_grad]))
        head_calls.append(len(chunks))
    assert head_calls[0] == 2 * head_calls[1] > 0  # checkpointed, each chunk runs again in backward; kept, once
    assert torch.equal(params[0], params[1]) and not torch.equal(params[0], torch.cat(
        [p.detach().flatten() for p in model.parameters() if p.requires_grad]))
    assert entropies[0] == entropies[1] > 0
    z = torch.randn(3, 5, requires_grad=True)
    head = torch.nn.Identity()
    logged = _chunk_logprobs(head, z, torch.tensor([0, 1, 2]), 1.0, entropy="detached")
    trained = _chunk_logprobs(head, z, torch.tensor([0, 1, 2]), 1.0, entropy=True)
    assert torch.equal(logged, trained)
    (through,) = torch.autograd.grad(trained[:, 1].sum(), z)  # the entropy carries a gradient...
    (none,) = torch.autograd.grad(logged[:, 1].sum(), z)  # ...unless it is only logged
    assert through.abs().sum() > 0 and torch.equal(none, torch.zeros_like(z))
