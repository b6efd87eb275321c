"""A vision-language policy in the in-process pipeline: what it supports, its episodes, its update model.

    unsupported_with_vlm(update="ppo")        # ["ppo (its loss has no pixel inputs ...", ...]: refused before compute
    vlm = ResidentVLM(base_model, ImageStore(ws.settings.images_dir))   # loaded once per rollout worker
    episodes = vlm.episodes(policy_id, adapter_dir, task, specs, group_size=8, sampling=s, max_total_tokens=2048,
                            tool_timeout=10.0)
    policy = load_vlm_for_update(base_model, adapter_dir, lora, store)   # the grpo/dpo stages' trainable VLM

A visual episode runs as a text episode does (stages/policy/agent_loop.py), turn by turn, recorded token-exact:
the prompt with its image placeholder tokens (loss_mask 0), each sampled turn with its behaviour log-probs
(loss_mask 1), the template's text and tool results (mask 0), and the ids of the episode's images in the
workspace's store, in placeholder order. A tool may return OpenAI content parts with an image (count_shapes'
`zoom`): the image is stored and expanded into its placeholders where it appears. The conversation primitive is
the policy service's (`VisualChatFormat`, `VisualResidentPolicy`), and the stored messages keep each image as
its `<image:SHA256>` reference (`marked_content`), the records the service writes. The first turn of a group is
one generate call (the prompt and its image are shared); later turns batch the episodes that show the same
images.

The rollout worker keeps its VLM resident (adapters loaded by folder); the update loads the VLM from files (a
fresh `add_vlm_lora` adapter on the language model, or the parent's), so the two do not share one model in
memory yet. Ray rollout actors (`rollout.workers > 1`) get each group's opening messages as records whose
images are references into the workspace's store (`opening_records`, made once by the driver): a prompt's
picture is drawn, encoded, validated and stored once, not once per actor, and an actor reads its bytes from the
store to build the pixel inputs.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

# add_turn and turn_seed: a visual turn is appended and seeded exactly as a text turn.
from stages.policy.agent_loop import Episode, EpisodeSpec, add_tool_results, add_turn, call_tools, turn_seed
from stages.policy.model import MODEL_LOADING
from stages.policy.sampling import SamplingConfig
from stages.policy.lora import add_vlm_lora
from stages.policy.vlm import VLMPolicy
from stages.policy.vlm_chat import image_ids_of, marked_content
from storage.images import ImageStore
from storage.schema import Message

if TYPE_CHECKING:
    from tasks.base import Prompt, Task

# Updates whose losses have no pixel inputs yet (grpo with its rloo and reinforce_pp presets, dpo and sft do).
# PPO's critic is a text value model (stages/update/ppo.py): it would score a visual episode without its images.
UPDATES_WITHOUT_PIXELS = ("ppo",)


def unsupported_with_vlm(*, backend: str = "hf", task: Task | None = None, update: str = "grpo",
                         projector_lora: bool = False, base_model: str | None = None) -> list[str]:
    """What of a run's settings the vision-language path does not support yet, one line each (empty: all
    supported). The one list the config check and the stages refuse by, before any compute. `base_model`:
    the VLM's folder, which vLLM may not run here (`vllm_vlm.vllm_problem`)."""
    problems = []
    if backend == "vllm" and base_model is not None:
        from stages.policy.vllm_vlm import vllm_problem

        if problem := vllm_problem(base_model):
            problems.append(f"rollout.backend 'vllm' ({problem})")
    if backend == "vllm" and projector_lora:
        # vLLM applies an adapter to the language model only: the projector's LoRA weights would not generate.
        problems.append("rollout.backend 'vllm' with lora.projector (vLLM applies LoRA to the language model only, "
                        "so episodes would be sampled without the projector's adapter: use hf, or no projector LoRA)")
    if task is not None and task.agent is not None:
        problems.append(f"task {task.name!r} (an external agent's episodes in the rollout stage; "
                        "`rlops serve` serves a VLM to agents)")
    if update in UPDATES_WITHOUT_PIXELS:
        problems.append(f"{update} (its loss has no pixel inputs; grpo, rloo, reinforce_pp, dpo and sft train a VLM)")
    return problems


def task_policy_problem(task: Task, vision_language: bool) -> str | None:
    """Why `task` cannot run on the policy, if it cannot: a task that shows images needs a vision-language one,
    and so do tools bound to a prompt (`Task.prompt_tools`: only the visual loop runs them yet)."""
    if vision_language:
        return None
    if task.images is not None:
        return (f"task {task.name!r} shows images, and the base model is text-only: use a vision-language base "
                "model (a folder whose config.json has a vision_config)")
    if task.prompt_tools is not None:
        return (f"task {task.name!r} has tools bound to its prompts (prompt_tools), which only a vision-language "
                "policy's episodes run yet")
    return None


def refuse_unsupported(base_model: str, problems: list[str]) -> None:
    """ValueError naming every unsupported setting (`unsupported_with_vlm`) of a run on a VLM base model."""
    if problems:
        raise ValueError(f"{base_model} is a vision-language model, and these are not supported with one yet: "
                         + "; ".join(problems))


class ResidentVLM:
    """A rollout worker's VLM, loaded once: on `hf`, a `VisualResidentPolicy` (adapters hot-loaded by folder, the
    HF sampler given each prompt's pixel inputs); on `vllm`, a `VLLMVisualPolicy` (the process's engine, images as
    vLLM's multimodal inputs); either with its conversation format (`VisualChatFormat`)."""

    def __init__(self, base_model: str, store: ImageStore, backend: str = "hf") -> None:
        if backend == "vllm":
            from stages.policy.vllm_vlm import VLLMVisualPolicy

            self.policy: Any = VLLMVisualPolicy(base_model, store)
        else:
            from stages.policy.vlm_resident import VisualResidentPolicy

            self.policy = VisualResidentPolicy(VLMPolicy.load(Path(base_model).expanduser(), store))
        self.store = store
        self.fingerprint = self.policy.vlm.fingerprint  # recorded with each rollout: the pixels are rebuilt by it

    def episodes(self, policy_id: str, adapter_dir: str | None, task: Task, specs: list[EpisodeSpec], *,
                 group_size: int, sampling: SamplingConfig, max_total_tokens: int, tool_timeout: float,
                 openings: dict[str, list[Message]] | None = None) -> list[Episode]:
        """Every episode of `specs` (groups of `group_size` consecutive specs sharing a prompt) under `policy_id`.
        `openings`: each prompt's opening records by prompt id (`opening_records`), when the caller made them."""
        out: list[Episode] = []
        for i in range(0, len(specs), group_size):
            opening = openings.get(specs[i].prompt.prompt_id) if openings else None
            out += self.group(policy_id, adapter_dir, task, specs[i : i + group_size], sampling=sampling,
                              max_total_tokens=max_total_tokens, tool_timeout=tool_timeout, opening=opening)
        return out

    def group(self, policy_id: str, adapter_dir: str | None, task: Task, specs: list[EpisodeSpec], *,
              sampling: SamplingConfig, max_total_tokens: int, tool_timeout: float,
              opening: list[Message] | None = None) -> list[Episode]:
        """The episodes of one prompt, turn by turn, grown token by token as `agent_loop.run_episodes` grows a
        text episode (its `add_turn` appends each turn). What differs: the opening messages and tool results
        become records with image references (`marked_content`), the chat format expands each image into its
        placeholders, the tools are the prompt's own (`Task.episode_tools`), and a generate call takes the
        episodes that show the same images (all of them on the first turn: one call for the group)."""
        start = time.monotonic()
        chat, store = self.policy.chat, self.store
        if opening is None:
            opening = opening_records(task, specs[0].prompt, store)
        prompt_ids = chat.encode(chat.render(opening, True))
        out = [Episode(messages=list(opening), token_ids=[], loss_mask=[], behavior_logprobs=[]) for _ in specs]
        for ep in out:
            ep.extend(prompt_ids)
        reserve = len(chat.encode(chat.end_of_turn(opening, Message("assistant", "x"))))
        tools = task.episode_tools(specs[0].prompt)

        def finish(i: int, reason: str, truncated: bool) -> None:
            out[i].finish_reason, out[i].truncated = reason, truncated
            out[i].gen_seconds = time.monotonic() - start

        active = list(range(len(out)))
        for turn in range(task.max_turns):
            room = {i: max_total_tokens - len(out[i].token_ids) - reserve for i in active}
            for i in [i for i in active if room[i] < 1]:
                finish(i, "max_tokens", True)
            active = [i for i in active if room[i] >= 1]
            calling = []
            for batch in _by_images(out, active):
                turn_sampling = replace(sampling, max_new_tokens=min(sampling.max_new_tokens, max(room[i] for i in batch)))
                samples = self.policy.generate(policy_id, adapter_dir, [out[i].token_ids for i in batch], turn_sampling,
                                               turn_seed(sampling.seed, [specs[i].seed for i in batch], turn),
                                               images=image_ids_of(out[batch[0]].messages))
                for i, sample in zip(batch, samples):
                    if sample.error is not None:  # vLLM ran other prompt ids than the recorded ones
                        out[i].fail(f"turn {turn + 1}: {sample.error}")
                        finish(i, "error", False)
                        continue
                    calls, budget_hit, length_cut = add_turn(out[i], sample, room[i], turn, chat, self.policy.eos_ids)
                    if budget_hit:
                        finish(i, "max_tokens", True)
                    elif not calls:
                        finish(i, "answer", length_cut)
                    elif turn == task.max_turns - 1:
                        finish(i, "max_turns", length_cut)
                    else:
                        calling.append((i, calls))
            active = []
            for i, calls in sorted(calling):
                ep, done = out[i], call_tools(calls, tools, tool_timeout)
                results = [Message("tool", marked_content(r.content, store), tool_call_id=c.id, name=c.name)
                           for c, r in zip(calls, done)]
                if not add_tool_results(ep, chat, results, sum(r.error for r in done), max_total_tokens - reserve):
                    finish(i, "max_tokens", True)  # the results do not fit: the episode ends without them
                    continue
                active.append(i)
        for ep in out:
            ep.image_ids = image_ids_of(ep.messages)
        return out


def opening_records(task: Task, prompt: Prompt, store: ImageStore) -> list[Message]:
    """A prompt's opening messages as an episode records them: each image validated, stored in `store` and written
    as its `<image:SHA256>` reference (`marked_content`)."""
    return [Message(m["role"], marked_content(m["content"], store)) for m in task.messages(prompt)]


def _by_images(episodes: list[Episode], active: list[int]) -> list[list[int]]:
    """The active episodes grouped by the images their conversations show (one generate call's prompts share
    their pixel inputs, `VisualResidentPolicy.generate`), in order of first appearance."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for i in active:
        groups.setdefault(tuple(image_ids_of(episodes[i].messages)), []).append(i)
    return list(groups.values())


def load_vlm_for_update(base_model: str, adapter_dir: str | None, lora: Any, store: ImageStore) -> VLMPolicy:
    """The VLM to train (fp32): the parent's adapter, trainable, or a fresh `lora` adapter on the language model
    only (`add_vlm_lora`: the vision tower stays frozen)."""
    base = VLMPolicy.load(Path(base_model).expanduser(), store)
    if adapter_dir is None:
        model = add_vlm_lora(base.model, lora)
    else:
        from peft import PeftModel

        with MODEL_LOADING:
            model = PeftModel.from_pretrained(base.model, adapter_dir, is_trainable=True)
    return VLMPolicy(model, base.processor, store)
