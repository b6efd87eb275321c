"""A vision-language policy in the in-process pipeline: what it supports, its episodes, its update model.

    unsupported_with_vlm(backend="vllm", task=task)   # ["rollout.backend 'vllm' ...", ...]: refused before compute
    vlm = ResidentVLM(base_model, ImageStore(ws.settings.images_dir))   # loaded once per rollout worker
    episodes = vlm.episodes(policy_id, adapter_dir, task, specs, group_size=8, sampling=s, max_total_tokens=2048)
    policy = load_vlm_for_update(base_model, adapter_dir, lora, store)   # the grpo stage's trainable VLM

A visual task's episode is single-turn here: the task's opening messages (a user message with image_url
parts) and one sampled answer. Each group is one `VLMPolicy.generate(messages, n=G)` call (the prompt and
its images are shared, so there is no padding), recorded token-exact: the prompt with its image placeholder
tokens (loss_mask 0), the sampled tokens with their behaviour log-probs (loss_mask 1), and the ids of the
images in the workspace's store. The stored messages keep each image as its `<image:SHA256>` reference
(stages.policy.vlm_chat.marked_content), the same records the policy service writes.

The rollout worker keeps its VLM resident and swaps LoRA weights per policy (`ResidentModel`, as the text
path's session does); the update loads the VLM from files (a fresh `add_vlm_lora` adapter on the language
model, or the parent's), so the two never share one model in memory yet.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.policy.agent_loop import Episode, EpisodeSpec
from stages.policy.sampling import SamplingConfig
from stages.policy.session import ResidentModel
from stages.policy.vlm import VLMPolicy, add_vlm_lora
from stages.policy.vlm_chat import marked_content
from storage.images import ImageStore
from storage.schema import Message

if TYPE_CHECKING:
    from tasks.base import Task

# Updates whose losses have no pixel inputs yet (the grpo stage's rloo and reinforce_pp presets do).
UPDATES_WITHOUT_PIXELS = ("sft", "dpo", "ppo")


def unsupported_with_vlm(*, backend: str = "hf", rollout_workers: int = 1, top_p: float = 1.0,
                         stop: Sequence[str] = (), task: Task | None = None, update: str = "grpo",
                         update_workers: int = 1, max_staleness: int = 0) -> list[str]:
    """What of a run's settings the vision-language path does not support yet, one line each (empty: all
    supported). The one list the config check and the stages refuse by, before any compute."""
    problems = []
    if backend != "hf":
        problems.append(f"rollout.backend {backend!r} (visual episodes are generated with transformers: use hf)")
    if rollout_workers > 1:
        problems.append(f"rollout.workers {rollout_workers} (Ray rollout actors; use 1)")
    if top_p < 1.0:
        problems.append(f"rollout.top_p {top_p} (a VLM samples its whole distribution: use 1.0)")
    if stop:
        problems.append(f"rollout.stop {list(stop)} (stop strings)")
    if task is not None and (task.max_turns > 1 or task.tools or task.agent is not None):
        problems.append(f"task {task.name!r} (multi-turn episodes, tools and external agents; "
                        "a single-turn task such as count_shapes runs)")
    if update in UPDATES_WITHOUT_PIXELS:
        problems.append(f"{update} (its loss has no pixel inputs; grpo, rloo and reinforce_pp train a VLM)")
    if update_workers > 1:
        problems.append(f"{update}.workers {update_workers} (Ray Train workers; use 1)")
    if max_staleness > 0:
        problems.append(f"max_staleness {max_staleness} (asynchronous generation; use 0)")
    return problems


def task_policy_problem(task: Task, vision_language: bool) -> str | None:
    """Why `task` cannot run on the policy, if it cannot: a task that shows images needs a vision-language one."""
    if task.images is not None and not vision_language:
        return (f"task {task.name!r} shows images, and the base model is text-only: use a vision-language base "
                "model (a folder whose config.json has a vision_config)")
    return None


def refuse_unsupported(base_model: str, problems: list[str]) -> None:
    """ValueError naming every unsupported setting (`unsupported_with_vlm`) of a run on a VLM base model."""
    if problems:
        raise ValueError(f"{base_model} is a vision-language model, and these are not supported with one yet: "
                         + "; ".join(problems))


class ResidentVLM:
    """A rollout worker's VLM: loaded once, the active policy's LoRA weights copied in before each shard."""

    def __init__(self, base_model: str, store: ImageStore) -> None:
        base = VLMPolicy.load(Path(base_model).expanduser(), store)
        self.resident = ResidentModel(base.model, base.processor)  # `tokenizer` holds the processor here
        self.store = store
        self.fingerprint = base.fingerprint  # recorded with each rollout: the pixels are rebuilt by this processor

    def episodes(self, policy_id: str, adapter_dir: str | None, task: Task, specs: list[EpisodeSpec], *,
                 group_size: int, sampling: SamplingConfig, max_total_tokens: int) -> list[Episode]:
        """Every episode of `specs` (groups of `group_size` consecutive specs sharing a prompt) under `policy_id`."""
        context = self.resident.activate(policy_id, adapter_dir)  # the base policy: adapter disabled
        policy = VLMPolicy(self.resident.model, self.resident.tokenizer, self.store)
        out: list[Episode] = []
        with context:
            for i in range(0, len(specs), group_size):
                out += visual_group(policy, task, specs[i : i + group_size], sampling, max_total_tokens)
        return out


def visual_group(policy: VLMPolicy, task: Task, specs: list[EpisodeSpec], sampling: SamplingConfig,
                 max_total_tokens: int) -> list[Episode]:
    """One group: the specs' shared prompt sampled len(specs) times in one call (seeded by the first spec's seed)."""
    start = time.monotonic()
    prompt = specs[0].prompt
    messages = task.messages(prompt)
    prompt_ids, _ = policy.prompt(messages)  # validates and stores the images before any compute
    room = max_total_tokens - len(prompt_ids)
    if room < 1:
        raise ValueError(f"prompt {prompt.prompt_id} is {len(prompt_ids)} tokens with its image placeholders, "
                         f"over rollout.max_total_tokens {max_total_tokens}")
    turn = replace(sampling, max_new_tokens=min(sampling.max_new_tokens, room))
    samples = policy.generate(messages, n=len(specs), sampling=turn, seed=specs[0].seed)
    opening = [Message(m["role"], marked_content(m["content"], policy.store)) for m in messages]
    seconds = time.monotonic() - start
    return [Episode(messages=opening + [Message("assistant", s.text)], token_ids=s.token_ids, loss_mask=s.loss_mask,
                    behavior_logprobs=s.behavior_logprobs, num_turns=1, finish_reason="answer",
                    truncated=s.finish_reason == "length", gen_seconds=seconds, image_ids=s.image_ids)
            for s in samples]


def load_vlm_for_update(base_model: str, adapter_dir: str | None, lora: Any, store: ImageStore) -> VLMPolicy:
    """The VLM to train (fp32): the parent's adapter, trainable, or a fresh `lora` adapter on the language model
    only (`add_vlm_lora`: the vision tower stays frozen)."""
    base = VLMPolicy.load(Path(base_model).expanduser(), store)
    if adapter_dir is None:
        model = add_vlm_lora(base.model, lora)
    else:
        from peft import PeftModel

        model = PeftModel.from_pretrained(base.model, adapter_dir, is_trainable=True)
    return VLMPolicy(model, base.processor, store)
