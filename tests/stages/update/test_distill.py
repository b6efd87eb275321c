"""On-policy distillation (`grpo.distill`, stages/update/distill.py): the student's samples scored by a teacher,
the per-token reverse KL as advantage; the teacher's log-probs stored with the batch and read on a rerun."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stages.common import StageContext
from stages.grpo import run
from stages.policy.logprobs import token_logprobs
from stages.reward_ref import RewardRef
from stages.update.config import Distill, GRPOConfig
from stages.update.data import Sample
from stages.update.train import train_on_batch
from tests.stages.test_grpo import TINY_LORA, VOCAB, make_workspace, sample, tiny_llama


@torch.no_grad()
def reverse_kl(student, teacher, prompts: torch.Tensor, seed: int) -> float:
    """Mean over the student's fresh samples' tokens of log p_student - log p_teacher (a reverse-KL estimate)."""
    samples, _, _ = sample(student, prompts, 16, seed)
    ids = torch.tensor([s.token_ids for s in samples])
    mask = torch.tensor([s.loss_mask for s in samples])
    gap = token_logprobs(student, ids, torch.ones_like(ids), mask) - token_logprobs(teacher, ids, torch.ones_like(ids), mask)
    return float(gap.sum() / mask.sum())


def with_teacher(teacher, samples: list[Sample]) -> list[Sample]:
    ids = torch.tensor([s.token_ids for s in samples])
    mask = torch.tensor([s.loss_mask for s in samples])
    with torch.no_grad():
        lp = token_logprobs(teacher, ids, torch.ones_like(ids), mask)
    return [Sample(s.token_ids, s.loss_mask, s.behavior_logprobs, teacher_logprobs=row.tolist())
            for s, row in zip(samples, lp)]


def test_the_student_moves_toward_the_teacher_with_no_reward_signal() -> None:
    from stages.policy.lora import add_lora

    student, teacher = add_lora(tiny_llama(0), TINY_LORA), tiny_llama(1).eval()
    prompts = torch.randint(0, VOCAB, (4, 4), generator=torch.Generator().manual_seed(0))
    config = GRPOConfig(lr=3e-2, micro_batch_size=16, lora=TINY_LORA, distill=Distill(teacher="tiny", coef=1.0))
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=config.lr)
    before = reverse_kl(student, teacher, prompts, seed=1000)
    history = []
    for step in range(8):
        samples, _, _ = sample(student, prompts, 8, seed=step)
        zero = torch.zeros(len(samples))  # every reward equal: GRPO alone would not move
        history += train_on_batch(student, optimizer, with_teacher(teacher, samples), zero, config, temperature=1.0)
    after = reverse_kl(student, teacher, prompts, seed=2000)
    assert after < 0.8 * before, f"reverse KL to the teacher {before:.3f} -> {after:.3f}"
    assert history[0]["teacher_kl"] > history[-1]["teacher_kl"] > 0

    # without the teacher the same zero advantages train nothing
    plain = add_lora(tiny_llama(0), TINY_LORA)
    weights = [p.detach().clone() for p in plain.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=config.lr, weight_decay=0.0)
    samples, _, _ = sample(plain, prompts, 8, seed=0)
    no_teacher = config.model_copy(update={"distill": None})
    train_on_batch(plain, opt, samples, torch.zeros(len(samples)), no_teacher, temperature=1.0)
    assert all(torch.equal(a, b) for a, b in zip(weights, [p for p in plain.parameters() if p.requires_grad]))


def test_the_teachers_logprobs_are_stored_with_the_batch_and_read_on_a_rerun(tmp_path: Path, monkeypatch) -> None:
    from stages.update import distill

    ws, parent, batch = make_workspace(tmp_path)
    tiny_llama(1).save_pretrained(tmp_path / "teacher", safe_serialization=True)
    config = GRPOConfig(lora=TINY_LORA, micro_batch_size=4, distill=Distill(teacher=str(tmp_path / "teacher")))
    ctx = StageContext(ws, run_name="distill")
    first = run(config, ctx, parent, [batch], RewardRef("toy"))
    metrics = ws.catalog.get_artifact(first.id)["meta"]["metrics"]
    # every group trains under a teacher, the one without reward signal too (11 rollouts have a reward)
    assert metrics["trained_rollouts"] == 11 and metrics["teacher_kl"] != 0
    (stored,) = (ws.root / "distill").glob("model-*/*.parquet")

    def no_teacher(*args, **kwargs):
        raise AssertionError("the teacher ran again")

    monkeypatch.setattr(distill, "_compute", no_teacher)
    again = run(config.model_copy(update={"lr": 3e-4}), ctx, parent, [batch], RewardRef("toy"))
    assert again.id != first.id and not again.cached
    assert ws.catalog.get_artifact(again.id)["meta"]["metrics"]["teacher_kl"] == pytest.approx(metrics["teacher_kl"])
    # another teacher is another update, even under the same path: the folder's content names it
    tiny_llama(2).save_pretrained(tmp_path / "teacher", safe_serialization=True)
    monkeypatch.undo()
    other = run(config, ctx, parent, [batch], RewardRef("toy"))
    assert other.id != first.id and len(list((ws.root / "distill").glob("model-*/*.parquet"))) == 2
    assert stored.exists()
