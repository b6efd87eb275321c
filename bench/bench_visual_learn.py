"""GRPO on count_shapes with the small VLM, through the policy and update functions directly: held-out accuracy
before and after, with the bootstrap interval `rlops eval compare` uses, and the time per step.

    nice -n 5 .ci/loopback .venv/bin/python bench/bench_visual_learn.py [--steps 16] [--out bench-visual.json]

The model is the one examples/vision/build_small_vlm.py builds (`make small-vlm`). Each step: `--prompts`
train prompts, `--group` samples each at temperature 1 (VLMPolicy.generate: token-exact, behaviour log-probs
recorded), the task's reward (`first_integer_match`), group advantages (GRPO's mean/std, zero-variance groups
skipped), and one `train_on_batch` update of a LoRA on the language model from the recorded samples, their
pixel inputs rebuilt from the stored images (`visual_training_sample`): what the pipeline's rollout, score and
grpo stages do, in one process and without the workspace tables. Evaluation: greedy, one sample per prompt, on
the first `--eval-prompts` of the task's test split (never trained on), as `rlops eval` does; the interval is
`stages.evaluate.bootstrap_interval` over the paired per-prompt differences, as in `rlops eval compare`.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from rewards.builtin import first_integer_match
from stages.evaluate import bootstrap_interval
from stages.policy.lora import LoRASettings
from stages.policy.model import cache_dir
from stages.policy.sampling import SamplingConfig
from stages.policy.vlm import VisualSample, VLMPolicy, add_vlm_lora
from stages.update.config import GRPOConfig
from stages.update.data import visual_training_sample
from stages.update.loss import group_advantages, zero_variance_groups
from stages.update.train import make_optimizer, train_on_batch
from storage.images import ImageStore
from storage.schema import Message, Rollout
from tasks import count_shapes
from tasks.base import Prompt, Task

MAX_NEW_TOKENS = 8  # the reply is a digit and <|im_end|>; a rambling sample is cut here and usually scores 0


def score(prompt: Prompt, sample: VisualSample) -> float:
    """The task's reward on one sampled reply (the reward takes a rollout: only its messages and metadata count)."""
    rollout = Rollout(rollout_id="r", batch_id="b", policy_id="p", task="count_shapes", split="train",
                      prompt_id=prompt.prompt_id, group_id="g", sample_idx=0,
                      messages=[Message("assistant", sample.text)], token_ids=[], loss_mask=[], behavior_logprobs=[],
                      num_turns=1, num_tool_calls=0, finish_reason=sample.finish_reason, truncated=False,
                      metadata=prompt.metadata, sampling={}, seed=0, gen_seconds=0.0)
    value, _ = first_integer_match(rollout)
    return value


def evaluate(policy: VLMPolicy, task: Task, prompts: list[Prompt]) -> list[float]:
    """Greedy success (0/1) per prompt."""
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)
    return [score(p, policy.generate(task.messages(p), n=1, sampling=greedy, seed=0)[0]) for p in prompts]


def grpo_step(policy: VLMPolicy, optimizer: Any, task: Task, prompts: list[Prompt], group: int, config: GRPOConfig,
              seed: int) -> dict[str, float]:
    """Sample a group per prompt, score, and one GRPO update on the groups with signal."""
    import torch

    sampling = SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS)
    start = time.perf_counter()
    samples, rewards, groups = [], [], []
    for i, p in enumerate(prompts):
        for s in policy.generate(task.messages(p), n=group, sampling=sampling, seed=seed * 1000 + i):
            samples.append(s)
            rewards.append(score(p, s))
            groups.append(i)
    generated = time.perf_counter()
    reward = torch.tensor(rewards)  # (N,)
    keep = ~zero_variance_groups(reward, groups)  # (N,)
    advantages = group_advantages(reward, groups, config.scale, config.baseline)[keep]
    training = [visual_training_sample(policy, s) for s, k in zip(samples, keep.tolist()) if k]
    history = train_on_batch(policy.model, optimizer, training, advantages, config, temperature=1.0)
    return {"reward_mean": float(reward.mean()), "groups_with_signal": len(set(g for g, k in zip(groups, keep.tolist()) if k)),
            "generate_s": generated - start, "update_s": time.perf_counter() - generated,
            "step_s": time.perf_counter() - start, "grad_norm": history[0]["grad_norm"] if history else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=cache_dir() / "models" / "SmolVLM-SmolLM2-135M-shapes")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=4, help="train prompts per step")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--eval-prompts", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench-visual-learn.json"))
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    build = json.loads((args.model / "build.json").read_text())
    task = count_shapes.make_task(**build["task"])
    train, test = task.prompts("train"), task.prompts("test")[: args.eval_prompts]
    base = VLMPolicy.load(args.model, ImageStore(Path(tempfile.mkdtemp(prefix="visual-learn-")) / "images"))
    # One micro-batch per step (32 sequences of ~60 tokens fit easily in CPU memory), no activation checkpointing
    # (it saves memory that is not short here, for ~1/3 more compute).
    config = GRPOConfig(lr=args.lr, micro_batch_size=args.prompts * args.group, micro_batch_tokens=None,
                        activation_checkpointing=False)
    policy = VLMPolicy(add_vlm_lora(base.model, config.lora), base.processor, base.store)
    before = evaluate(policy, task, test)  # LoRA B = 0: the built model itself
    print(f"start: held-out accuracy {sum(before) / len(before):.3f}", flush=True)
    optimizer = make_optimizer(policy.model, None, config)
    rng = random.Random(args.seed)
    steps = []
    for step in range(args.steps):
        metrics = grpo_step(policy, optimizer, task, rng.sample(train, args.prompts), args.group, config, seed=step)
        steps.append(metrics)
        print(f"step {step:3d} " + " ".join(f"{k} {v:.3f}" for k, v in metrics.items()), flush=True)
    policy.model.eval()
    after = evaluate(policy, task, test)
    low, high = bootstrap_interval([b - a for a, b in zip(before, after)])
    result = {"model": str(args.model), "build": build, "steps": args.steps, "prompts": args.prompts,
              "group": args.group, "lr": args.lr, "lora": config.lora.model_dump(), "eval_prompts": len(test),
              "accuracy_start": sum(before) / len(before), "accuracy_final": sum(after) / len(after),
              "difference_interval_95": [low, high],
              "step_s_mean": sum(s["step_s"] for s in steps) / len(steps),
              "generate_s_mean": sum(s["generate_s"] for s in steps) / len(steps),
              "update_s_mean": sum(s["update_s"] for s in steps) / len(steps), "per_step": steps}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("per_step", "build")}, indent=1))


if __name__ == "__main__":
    main()
