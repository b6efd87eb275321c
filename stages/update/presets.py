"""RLOO and REINFORCE++: critic-free policy gradients that differ from GRPO only in the advantage.

Each is a small typed config with the knobs that make sense for it; `to_grpo()` gives the GRPO update
that computes exactly that algorithm (stages/update/loss.py holds the baselines and scales), so both run
through the grpo stage and its checkpoint id is the id of that update: the same computation, the same id.

    RLOOConfig(lr=3e-4).to_grpo()          # baseline "rloo" (leave-one-out), no std scaling
    ReinforcePPConfig().to_grpo()          # baseline and std of the whole batch (global normalisation)
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stages.common import Operational
from stages.policy.lora import LoRASettings
from stages.update.config import GRPOConfig


class _PolicyGradient(BaseModel):
    """The training knobs every critic-free update shares (the reasons for each default: GRPOConfig)."""

    model_config = ConfigDict(extra="forbid")

    lr: float = 1e-4  # as GRPO's: the reference TRL run's rate for SmolLM2 LoRA
    epochs: int = 1  # 1 = strictly on-policy; more reuse the batch under the clip
    micro_batch_size: int = Field(8, ge=1)
    micro_batch_tokens: int | None = Field(384, ge=1)
    activation_checkpointing: bool = Operational(True)
    workers: int = Operational(1, ge=1)
    max_grad_norm: float = 1.0
    eps_low: float = 0.2  # PPO's clip, active only when epochs > 1
    eps_high: float = 0.2
    beta: float = 0.0  # k3 KL to the base model as a loss term (0: none)
    lora: LoRASettings = Field(default_factory=LoRASettings)

    def _common(self) -> dict[str, Any]:
        return self.model_dump()


class RLOOConfig(_PolicyGradient):
    """RLOO (Ahmadian et al., arXiv 2402.14740; OpenRLHF's `rloo`): advantage = reward minus the mean of the
    group's OTHER samples, not divided by a std. The loss aggregation stays GRPO's token mean, so a
    comparison with GRPO differs in the advantage alone."""

    def to_grpo(self) -> GRPOConfig:
        return GRPOConfig(**self._common(), baseline="rloo", scale="none")


class ReinforcePPConfig(_PolicyGradient):
    """REINFORCE++ (Hu, arXiv 2501.03262): no critic and no group baseline; the advantages are normalised over
    the whole batch ((r - batch mean) / batch std), which the paper argues is more stable than a per-prompt
    std. Every rollout trains, including groups whose samples agree (their advantage is not 0 here).

    The paper folds a per-token KL penalty into the reward; here the KL (if beta > 0) is GRPO's k3 loss term
    to the base model, as in OpenRLHF's `use_kl_loss` variant."""

    def to_grpo(self) -> GRPOConfig:
        return GRPOConfig(**self._common(), baseline="batch", scale="batch", skip_zero_variance=False)
