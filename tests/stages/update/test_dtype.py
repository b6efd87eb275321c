"""`grpo.dtype: bfloat16`: the update runs over a bf16 base with the LoRA weights, their gradients and AdamW in
fp32; another checkpoint id than the fp32 update's, nearly the same step; in a run, one resident model for
generation and update when `rollout.dtype` is bf16 too."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from stages.common import StageContext
from stages.grpo import run
from stages.policy.session import PolicySession
from stages.reward_ref import RewardRef
from tests.stages.test_grpo import STAGE, make_workspace


def _lora(ws, policy_id: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(ws.catalog.get_checkpoint(policy_id)["adapter_uri"]) / "adapter_model.safetensors"))


def test_a_bf16_base_trains_fp32_lora_weights_under_its_own_id(tmp_path: Path) -> None:
    ws, parent, batch = make_workspace(tmp_path)
    ctx = StageContext(ws, run_name="dtype")
    lr = {"lr": 1e-2}  # a step large enough to compare directions
    full = run(STAGE.model_copy(update=lr), ctx, parent, [batch], RewardRef("toy"))
    half = run(STAGE.model_copy(update={**lr, "dtype": "bfloat16"}), ctx, parent, [batch], RewardRef("toy"))
    same = run(STAGE.model_copy(update={**lr, "dtype": None}), ctx, parent, [batch], RewardRef("toy"))
    assert half.id != full.id and same.id == full.id and same.cached  # unset is the fp32 update, id unchanged

    a, b = _lora(ws, full.id), _lora(ws, half.id)
    assert {t.dtype for t in b.values()} == {torch.float32}  # the adapter stays fp32 over the bf16 base
    moved_a = torch.cat([a[k].flatten() for k in sorted(a) if "lora_B" in k])  # B starts at 0: its value is the step
    moved_b = torch.cat([b[k].flatten() for k in sorted(a) if "lora_B" in k])
    assert float(moved_a.abs().max()) > 1e-3 and not torch.equal(moved_a, moved_b)
    assert float(torch.nn.functional.cosine_similarity(moved_a, moved_b, dim=0)) > 0.9


def test_a_run_with_both_dtypes_bf16_holds_one_resident_model(tiny_model_dir: Path) -> None:
    from stages.policy.lora import LoRASettings

    with PolicySession() as session:
        trained = session.for_update(str(tiny_model_dir), "ck-parent", None, LoRASettings(r=4, alpha=8), "bfloat16")
        assert next(trained.model.base_model.model.parameters()).dtype == torch.bfloat16
        assert {p.dtype for p in trained.model.parameters() if p.requires_grad} == {torch.float32}
        session.updated(trained, "ck-next")
        resident, _ = session.generation(str(tiny_model_dir), "ck-next", str(tiny_model_dir), "bfloat16")
        assert resident is trained and session.stats()["models"] == 1
        assert resident.copies == {"memory": 0, "files": 0}  # the trained weights are already there
        session.for_update(str(tiny_model_dir), "ck-other", None, LoRASettings(r=4, alpha=8))
        assert session.stats()["models"] == 2  # an fp32 update (grpo.dtype unset) has its own model


def test_the_update_group_key_tells_dtypes_apart() -> None:
    from stages.update.workers import _group_key

    assert _group_key("m", 2) == _group_key("m", 2, "float32") != _group_key("m", 2, "bfloat16")
