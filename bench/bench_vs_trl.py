"""The same GRPO work with TRL's `GRPOTrainer` and with rlops: seconds per step and peak RSS.

    .venv/bin/python bench/bench_vs_trl.py [--steps 5] [--max-new-tokens 32] [--side both|trl|rlops] [--trl-tile]

Work per step, on both sides: SmolLM2-135M-Instruct (fp32) with a fresh LoRA (r=16, alpha=32, dropout 0,
q/k/v/o_proj), 4 arithmetic prompts (`arithmetic`, digits=2; the same consecutive train prompts per
step on both sides) x G=8 samples, at most `--max-new-tokens` new tokens, temperature 1.0, top_p 1,
reward 1.0 when the last number of the completion equals the answer (`rewards.builtin.last_number`,
what `numeric_match` uses), group-normalised advantages, token-mean loss, beta 0, AdamW lr 1e-4,
grad-norm clip 1.0, ONE optimizer step over the 32 completions in micro-batches of 8.

- TRL: `GRPOTrainer` (per_device_train_batch_size=8 x gradient_accumulation_steps=4, num_generations=8,
  generation_batch_size=32, loss_type="dapo", no shuffling), LoRA through `peft_config=`. A step is
  timed from `on_step_begin` to `on_step_end` (generation, reward, forward/backward, optimizer step).
  Everything else is TRL's default, notably `gradient_checkpointing=True` (turn it off with
  `--trl-no-gradient-checkpointing`) and the per-token entropy it computes for logging. With
  `--trl-tile`, a second TRL run shrinks the tiles of TRL's chunked LM-head log-prob kernel
  (`trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE`, default 4096 tokens, and
  `trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE`, default 32768 vocabulary columns) to 512 x 8192:
  off Triton devices (CPU) the torch fallback allocates several fp32 temporaries of one whole tile.
- rlops: what `flows.pipeline.train` does per step, everything persisted in one workspace (a temporary
  folder): `stages.rollout.run` -> `stages.score.run` -> `stages.grpo.run`, the policy chained from
  step to step starting at the base model. A step is timed around the three calls, so it includes
  loading the policy for generation and again for training, the Parquet/catalog/MLflow writes and
  the checkpoint save (adapter + optimizer state). GRPO runs with rlops' defaults otherwise:
  activation checkpointing, micro-batches of at most 8 sequences and 384 padded tokens.

Each side runs in its own subprocess (this script re-invoked with `--child`), so each peak RSS (from
`os.wait4`, the kernel's figure for that process) is its own. The first step of each side is a
warm-up: listed, but left out of the median. The machine's other load hits whatever runs at the
time, so compare medians from a quiet machine. The per-step lines also give the mean reward, the
mean completion length and the fraction of groups whose rewards all agree: generation dominates,
and two samplers that stop at different lengths do different amounts of work; rlops trains only on
groups with signal (a step where every group agrees does no forward/backward at all), while TRL
runs the forward/backward over all 32 completions (their advantages are 0).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import loopback  # bench/loopback.py: run under .ci/loopback

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "SmolLM2-135M-Instruct"
TASK_NAME, TASK_PARAMS = "arithmetic", {"digits": 2}
PROMPTS, GROUP, MICRO_BATCH = 4, 8, 8
LR, TEMPERATURE = 1e-4, 1.0
LORA_R, LORA_ALPHA, LORA_TARGETS = 16, 32, ["q_proj", "k_proj", "v_proj", "o_proj"]
TILE_TOKENS, TILE_VOCAB = 512, 8192
# (module, attribute) of TRL's tile knobs, and the value each takes under --trl-tile
TRL_TILE_KNOBS = [("trl.kernels.chunked_logprob", "TOKEN_CHUNK_SIZE", TILE_TOKENS),
                  ("trl.trainer.utils", "_CHUNKED_LOGPROB_CHUNK_SIZE", TILE_VOCAB)]

SHORT = {"trl": "TRL", "trl-tile": "TRL-tile", "rlops": "rlops", "rlops-equal": "rlops-equal",
         "rlops-files": "rlops-files"}
LABELS = {
    "trl": "TRL GRPOTrainer (defaults)",
    "trl-tile": f"TRL GRPOTrainer (tile {TILE_TOKENS} tokens x {TILE_VOCAB} vocab)",
    "rlops": "rlops rollout+score+grpo (persisted, resident policy, defaults)",
    "rlops-equal": "rlops, equal work (resident, skip_zero_variance off: updates on all 32 completions)",
    "rlops-files": "rlops, every stage loading its model from files (before the resident policy)",
}
RLOPS_SIDES = ("rlops", "rlops-equal", "rlops-files")


# ---------------------------------------------------------------- children (one side each)


def train_prompts(n: int) -> tuple[Any, list]:
    """The task and its first `n` train prompts in order: what rlops' `select_prompts` gives steps 0, 1, ..."""
    from stages.rollout import select_prompts
    from tasks.base import load_task

    task = load_task(TASK_NAME, TASK_PARAMS)
    return task, select_prompts(task.prompts("train"), n, 0)


def run_trl(args: argparse.Namespace, tile: bool) -> dict[str, Any]:
    import importlib

    if tile:
        missing = []
        for module, attr, value in TRL_TILE_KNOBS:
            mod = importlib.import_module(module)
            if not hasattr(mod, attr):
                missing.append(f"{module}.{attr}")
            else:
                setattr(mod, attr, value)  # read at call time, as module globals
        if missing:
            return {"skipped": f"this TRL has no tile knob {', '.join(missing)}: no tiled variant"}

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rewards.builtin import last_number
    from stages.policy.model import prepare_default_model

    if args.threads:
        torch.set_num_threads(args.threads)
    task, prompts = train_prompts(PROMPTS * args.steps)
    dataset = Dataset.from_list([{"prompt": task.messages(p), "answer": float(p.metadata["answer"])} for p in prompts])

    def correct(completions: list, answer: list, **kwargs: Any) -> list[float]:
        out = []
        for completion, expected in zip(completions, answer):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            value = last_number(text or "")
            out.append(float(value is not None and abs(value - expected) <= 1e-6))
        return out

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.logs: list[dict[str, Any]] = []
            self._t0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self._t0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.logs.append(dict(logs))

    out_dir = tempfile.mkdtemp(prefix="bench-trl-")
    config = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=MICRO_BATCH,  # completions per micro-batch
        gradient_accumulation_steps=PROMPTS * GROUP // MICRO_BATCH,  # one optimizer step = 32 completions
        num_generations=GROUP,
        generation_batch_size=PROMPTS * GROUP,  # 4 prompts x 8, generated in one batch like rlops' shard
        max_completion_length=args.max_new_tokens,
        temperature=TEMPERATURE,
        top_p=1.0,
        beta=0.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",  # token mean over the whole accumulated batch, as rlops' token_mean
        scale_rewards="group",
        shuffle_dataset=False,  # step i sees the same 4 prompts as rlops' step i
        logging_steps=1,
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        gradient_checkpointing=not args.trl_no_gradient_checkpointing,
        max_steps=args.steps,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    timer = StepTimer()
    lora = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=LORA_TARGETS,
                      task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=str(prepare_default_model()), reward_funcs=correct, args=config,
                          train_dataset=dataset, peft_config=lora, callbacks=[timer])
    try:
        trainer.train()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    knobs = {f"{m}.{a}": getattr(importlib.import_module(m), a, None) for m, a, _ in TRL_TILE_KNOBS}
    return {
        "seconds": timer.seconds,
        "reward_mean": [log.get("reward") for log in timer.logs],
        "completion_tokens_mean": [log.get("completions/mean_length") for log in timer.logs],
        "zero_std_frac": [log.get("frac_reward_zero_std") for log in timer.logs],
        "threads": torch.get_num_threads(),
        "notes": {"gradient_checkpointing": config.gradient_checkpointing, **knobs},
    }


def _timed(owner: Any, name: str, spent: list[float]) -> None:
    """Wrap `owner.name` so that the seconds spent in it are added to spent[0]."""
    fn = getattr(owner, name)

    def timed(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t0

    setattr(owner, name, timed)


def run_rlops(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    # What a pipeline process has imported before its first step (the TRL side too, before its timer).
    import peft  # noqa: F401
    import torch
    import transformers  # noqa: F401

    import stages.policy.load
    import stages.policy.session
    import stages.update.train
    from flows.pipeline import resident

    from rewards.base import RewardSpec
    from stages import grpo, rollout, score
    from stages.common import StageContext, base_policy
    from stages.policy.lora import LoRASettings
    from stages.reward_ref import RewardRef
    from stages.update.config import GRPOConfig
    from storage.settings import Settings
    from storage.workspace import Workspace

    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="bench-rlops-"))
    try:
        ws = Workspace(Settings(workspace=root, data_root=str(root / "data"), mlflow_uri=f"sqlite:///{root / 'mlflow.db'}",
                                mlflow_artifacts=str(root / "mlartifacts")))
        ws.tracker  # the MLflow database is created once per workspace, not per step
        ctx = StageContext(ws, run_name="bench")
        # Model loading: base (+ adapter) for generation, for the update, and adapter weight copies.
        loading = [0.0]
        _timed(stages.policy.load, "load_policy", loading)
        _timed(stages.update.train, "_load_trainable", loading)
        _timed(stages.policy.session.ResidentModel, "_load", loading)
        _timed(stages.policy.session.ResidentModel, "fresh", loading)
        task = rollout.TaskSpec(name=TASK_NAME, params=TASK_PARAMS)
        rollout_cfg = rollout.RolloutConfig(prompts_per_step=PROMPTS, group_size=GROUP, max_new_tokens=args.max_new_tokens,
                                            temperature=TEMPERATURE, groups_per_shard=PROMPTS)
        score_cfg = score.ScoreConfig(rewards=[RewardSpec(name="correct", fn="rewards.builtin.numeric_match")])
        grpo_cfg = GRPOConfig(lr=LR, micro_batch_size=MICRO_BATCH, skip_zero_variance=variant != "rlops-equal",
                              lora=LoRASettings(r=LORA_R, alpha=LORA_ALPHA, dropout=0.0, target_modules=LORA_TARGETS))
        reward = RewardRef.configured(score_cfg, "total")
        policy = base_policy(ws, MODEL)
        seconds, rewards, lengths, zero_std, load_s = [], [], [], [], []
        with resident(ctx, enabled=variant != "rlops-files") as ctx:
            for step in range(args.steps):
                loading[0] = 0.0
                t0 = time.perf_counter()
                batch = rollout.run(rollout_cfg, ctx, policy_id=policy, task=task, split="train", step=step)
                scored = score.run(score_cfg, ctx, batches=[batch.id])
                policy = grpo.run(grpo_cfg, ctx, parent_policy=policy, batches=[batch.id], reward=reward).id
                seconds.append(time.perf_counter() - t0)
                load_s.append(loading[0])
                gen = ws.catalog.get_artifact(batch.id)["meta"]["metrics"]
                rewards.append(ws.catalog.get_artifact(scored.id)["meta"]["metrics"].get("total.mean"))
                lengths.append(gen["sampled_tokens"] / gen["rollouts"])
                zero_std.append(ws.catalog.get_artifact(policy)["meta"]["metrics"].get("frac_zero_variance_groups"))
                print(f"rlops step {step}: {seconds[-1]:.2f} s ({load_s[-1]:.2f} s loading models), reward {rewards[-1]}, "
                      f"policy {policy}", file=sys.stderr)
        share = sum(load_s[1:]) / sum(seconds[1:]) if len(seconds) > 1 else load_s[0] / seconds[0]
        return {"seconds": seconds, "reward_mean": rewards, "completion_tokens_mean": lengths,
                "zero_std_frac": zero_std, "threads": torch.get_num_threads(),
                "notes": {"model_loading_s_per_step": fmt(load_s, 2), "model_loading_share": f"{share:.1%}"}}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def child_main(args: argparse.Namespace) -> None:
    if args.child in RLOPS_SIDES:
        result = run_rlops(args, args.child)
    else:
        result = run_trl(args, tile=args.child == "trl-tile")
    Path(args.result).write_text(json.dumps(result))


# ---------------------------------------------------------------- parent: run the sides, report


def launch(child: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one side in its own process; its result plus `peak_rss_mib` (that process's ru_maxrss)."""
    fd, result_path = tempfile.mkstemp(prefix=f"bench-{child}-", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", child, "--result", result_path,
           "--steps", str(args.steps), "--max-new-tokens", str(args.max_new_tokens)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.trl_no_gradient_checkpointing:
        cmd.append("--trl-no-gradient-checkpointing")
    print(f"--- {LABELS[child]}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sys.stderr)  # children's chatter on stderr; the report on stdout
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    try:
        text = Path(result_path).read_text()
        result = json.loads(text) if text else {"error": f"exit status {proc.returncode}, no result"}
    finally:
        os.unlink(result_path)
    if proc.returncode != 0:
        result.setdefault("error", f"exit status {proc.returncode}")
    # ru_maxrss is KiB on Linux, bytes on macOS
    result["peak_rss_mib"] = usage.ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)
    result["wall_s"] = wall
    return result


def median_step(seconds: list[float]) -> tuple[float, str]:
    """Median without the warm-up step; with a single step, that step (flagged)."""
    if len(seconds) > 1:
        return statistics.median(seconds[1:]), f"over {len(seconds) - 1} steps after 1 warm-up"
    return seconds[0], "over the warm-up step only (use --steps >= 2)"


def fmt(values: list, digits: int) -> str:
    return "[" + ", ".join("-" if v is None else f"{v:.{digits}f}" for v in values) + "]"


def report(results: dict[str, dict[str, Any]]) -> None:
    medians: dict[str, float] = {}
    for child, r in results.items():
        label = LABELS[child]
        if "skipped" in r:
            print(f"{label}: skipped: {r['skipped']}")
            continue
        if "error" in r or not r.get("seconds"):
            print(f"{label}: FAILED ({r.get('error', 'no steps timed')}), peak RSS {r['peak_rss_mib']:.0f} MiB")
            continue
        med, how = median_step(r["seconds"])
        medians[child] = med
        print(f"{label}: median {med:.2f} s/step {how} (steps: {fmt(r['seconds'], 2)}), "
              f"peak RSS {r['peak_rss_mib']:.0f} MiB")
        notes = ", ".join(f"{k}={v}" for k, v in r.get("notes", {}).items())
        print(f"    reward mean per step {fmt(r['reward_mean'], 3)}, completion tokens mean per step "
              f"{fmt(r['completion_tokens_mean'], 1)}, zero-variance group fraction per step "
              f"{fmt(r.get('zero_std_frac', []), 2)}, torch threads {r.get('threads')}, process wall "
              f"{r['wall_s']:.1f} s" + (f"; {notes}" if notes else ""))
    rss = {child: r["peak_rss_mib"] for child, r in results.items() if child in medians}
    for side in RLOPS_SIDES:
        if side not in medians:
            continue
        for child in ("trl", "trl-tile"):
            if child in medians:
                print(f"ratio {SHORT[child]}/{SHORT[side]}: {medians[child] / medians[side]:.2f} (>1 means rlops is faster); "
                      f"peak RSS {SHORT[side]}/{SHORT[child]}: {rss[side] / rss[child]:.2f}")
    if "rlops" in medians and "rlops-files" in medians:
        print(f"ratio rlops-files/rlops (what the resident policy saves): {medians['rlops-files'] / medians['rlops']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps per side; the first is a warm-up")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--side", choices=["both", "trl", "rlops"], default="both")
    ap.add_argument("--trl-tile", action="store_true",
                    help=f"also run TRL with its log-prob tile shrunk to {TILE_TOKENS} tokens x {TILE_VOCAB} vocab")
    ap.add_argument("--trl-no-gradient-checkpointing", action="store_true",
                    help="TRL without gradient checkpointing (its default is on, as is rlops' activation_checkpointing)")
    ap.add_argument("--skip-trl-defaults", action="store_true",
                    help="with --trl-tile: run only the faster (tiled) TRL")
    ap.add_argument("--threads", type=int, default=None, help="torch threads in each side (default: torch's choice)")
    ap.add_argument("--child", choices=list(LABELS), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    if args.child:
        child_main(args)
        return

    from importlib.metadata import version

    from stages.policy.model import prepare_default_model

    path = prepare_default_model()  # converted once, before any timing
    sides = {"both": ["trl", "trl-tile", *RLOPS_SIDES], "trl": ["trl", "trl-tile"], "rlops": list(RLOPS_SIDES)}[args.side]
    if args.skip_trl_defaults:
        sides = [s for s in sides if s != "trl"]
    if not args.trl_tile:
        sides = [s for s in sides if s != "trl-tile"]
    print(f"model {path}; {PROMPTS} prompts x G={GROUP}, max {args.max_new_tokens} new tokens, {args.steps} steps; "
          f"torch {version('torch')}, transformers {version('transformers')}, trl {version('trl')}, "
          f"peft {version('peft')}; {os.cpu_count()} CPUs", flush=True)
    results = {child: launch(child, args) for child in sides}
    report(results)


if __name__ == "__main__":
    loopback.enter()
    main()
