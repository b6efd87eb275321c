"""The parity run, whole run to whole run, against TRL's GRPOTrainer doing the same training, back to back.

    .ci/loopback .venv/bin/python bench/bench_parity_vs_trl.py [--side both|rlops|trl] [--workdir /tmp/rlops-parity-vs-trl]
        [--set rollout.dtype=bfloat16 ...]   # settings for rlops' run, as `rlops run --set` takes them

- rlops: `rlops run configs/arithmetic_trl_parity.yaml` in a fresh workspace, as a user runs it (its own process:
  imports, the Prefect server, the model, 40 steps, greedy evaluations of 100 held-out prompts at steps 0, 20, 40).
- TRL: `GRPOTrainer` with the same training (bench/bench_vs_trl.py's settings: SmolLM2-135M-Instruct fp32, LoRA r=16
  on q/k/v/o, 4 prompts x 8, at most 32 new tokens, T=1, beta 0, lr 1e-4, token mean, the same consecutive train
  prompts per step; TRL's defaults otherwise, gradient checkpointing included), 40 steps, and the same evaluations
  (100 held-out prompts, greedy, 32 new tokens, one batched `generate`, reward 1 when the last number is the sum) at
  steps 0, 20 and 40, timed inside its run, in its own process.

Each side's wall is its process's, start to exit; "time to 53 %" is from the process's start to the end of the first
evaluation at or above 53 %. Then, untimed, an independent evaluation of both final policies by the same code (base +
the final LoRA adapter, the 100 held-out prompts, greedy): what each run's own evaluation says, checked from outside.
For rlops, where its time went (stage_runs): training rollouts, evaluations, updates, rewards, the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import loopback  # bench/loopback.py: run under .ci/loopback

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "configs" / "arithmetic_trl_parity.yaml"
STEPS, EVERY, TARGET, N_EVAL, NEW_TOKENS = 40, 20, 0.53, 100, 32
TEST_PARAMS = {"digits": 2, "operators": "+", "n_train": 2000, "n_test": 100, "seed": 0}  # the parity config's task


def held_out() -> tuple[list[list[dict[str, str]]], list[float]]:
    """The parity config's evaluation prompts (its task's test split, first 100) and their answers."""
    from tasks.base import load_task

    task = load_task("arithmetic", TEST_PARAMS)
    prompts = task.prompts("test")[:N_EVAL]
    return [task.messages(p) for p in prompts], [float(p.metadata["answer"]) for p in prompts]


def greedy_accuracy(model: Any, tokenizer: Any) -> float:
    """Greedy accuracy of `model` on the held-out prompts: one left-padded batch, 32 new tokens."""
    import torch

    from rewards.builtin import last_number

    chats, answers = held_out()
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(**batch, do_sample=False, max_new_tokens=NEW_TOKENS, use_cache=True, pad_token_id=tokenizer.pad_token_id)
    model.train(was_training)
    replies = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(v is not None and abs(v - a) <= 1e-6 for v, a in ((last_number(r), a) for r, a in zip(replies, answers))) / len(answers)


def trl_child(adapter_out: Path, result: Path, started: float, steps: int = STEPS) -> None:
    """TRL's whole run (see the module docstring); writes its evaluations and times to `result`."""
    from bench_vs_trl import GROUP, LORA_ALPHA, LORA_R, LORA_TARGETS, LR, MICRO_BATCH, PROMPTS, TEMPERATURE, train_prompts
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rewards.builtin import last_number
    from stages.policy.model import prepare_default_model

    task, prompts = train_prompts(PROMPTS * steps)
    dataset = Dataset.from_list([{"prompt": task.messages(p), "answer": float(p.metadata["answer"])} for p in prompts])
    path = str(prepare_default_model())
    tokenizer = AutoTokenizer.from_pretrained(path)
    evals: list[dict[str, float]] = []

    def correct(completions: list, answer: list, **kwargs: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        values = [last_number(t or "") for t in texts]
        return [float(v is not None and abs(v - a) <= 1e-6) for v, a in zip(values, answer)]

    class Evaluate(TrainerCallback):
        def _eval(self, step: int, model: Any) -> None:
            accuracy = greedy_accuracy(model, tokenizer)
            evals.append({"step": step, "accuracy": accuracy, "at_s": time.time() - started})
            print(f"TRL step {step}: held-out accuracy {accuracy:.2f} at {evals[-1]['at_s']:.0f} s", file=sys.stderr)

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self._eval(0, model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % EVERY == 0:
                self._eval(state.global_step, model)

    out_dir = tempfile.mkdtemp(prefix="bench-trl-")
    config = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=MICRO_BATCH, gradient_accumulation_steps=PROMPTS * GROUP // MICRO_BATCH,
        num_generations=GROUP, generation_batch_size=PROMPTS * GROUP, max_completion_length=NEW_TOKENS,
        temperature=TEMPERATURE, top_p=1.0, beta=0.0, learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=1.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group",
        shuffle_dataset=False, logging_steps=1, report_to="none", use_cpu=True, bf16=False, max_steps=steps,
        save_strategy="no", disable_tqdm=True, seed=0)
    lora = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=path, reward_funcs=correct, args=config, train_dataset=dataset, peft_config=lora,
                          callbacks=[Evaluate()])
    trainer.train()
    finished = time.time() - started
    trainer.model.save_pretrained(str(adapter_out))  # after the clock: for the independent evaluation
    result.write_text(json.dumps({"evals": evals, "train_end_s": finished,
                                  "gradient_checkpointing": config.gradient_checkpointing}))


def run_side(name: str, work: Path, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """One side in its own process: its wall, its evaluations, and where its final adapter is. `overrides`: rlops'
    `--set` settings."""
    start = time.time()
    if name == "rlops":
        ws = work / "ws-rlops"
        cmd = [str(ROOT / ".venv" / "bin" / "rlops"), "run", str(CONFIG), "--workspace", str(ws),
               *(a for o in overrides for a in ("--set", o))]
        result: dict[str, Any] = {}
    else:
        result_file, adapter = work / "trl.json", work / "trl-adapter"
        cmd = [sys.executable, __file__, "--child", str(adapter), str(result_file), str(start)]
    print(f"--- {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, stdout=sys.stderr)
    wall = time.time() - start
    if proc.returncode:
        return {"error": f"exit status {proc.returncode}", "wall_s": wall}
    if name == "rlops":
        result = rlops_result(work / "ws-rlops", start)
    else:
        result = json.loads(result_file.read_text()) | {"adapter": str(adapter)}
    return result | {"wall_s": wall}


def rlops_result(ws: Path, start: float) -> dict[str, Any]:
    """The rlops run's evaluations (accuracy, seconds from the start to each one's end), its final adapter and
    where its time went."""
    import duckdb

    from storage.settings import Settings
    from storage.sql import open_views

    views = open_views(Settings.from_env(str(ws)))
    con: duckdb.DuckDBPyConnection = views.con
    evals = con.execute(
        "SELECT e.value, epoch(s.finished_at), e.policy_id FROM evals e JOIN stage_runs s "
        "ON s.artifact_id = e.eval_batch_id AND s.stage = 'evaluate' WHERE e.metric = 'accuracy' ORDER BY 2").fetchall()
    spent = dict(con.execute(
        "SELECT CASE WHEN stage = 'rollout' AND artifact_id IN (SELECT json_extract_string(a.meta, '$.rollouts') "
        "FROM artifacts a WHERE a.kind = 'evals') THEN 'evaluation rollouts' ELSE stage END, "
        "sum(epoch(finished_at) - epoch(started_at)) FROM stage_runs GROUP BY 1").fetchall())
    final = evals[-1][2]
    adapter = con.execute("SELECT adapter_uri FROM checkpoints WHERE policy_id = ?", [final]).fetchone()[0]
    return {"evals": [{"step": i * EVERY, "accuracy": v, "at_s": t - start} for i, (v, t, _) in enumerate(evals)],
            "spent_s": spent, "adapter": str(adapter), "final": final}


def independent(adapter: str) -> float:
    """Greedy held-out accuracy of base + `adapter`, by this script's evaluation code (the same for both sides)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.policy.model import prepare_default_model

    path = str(prepare_default_model())
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), adapter)
    return greedy_accuracy(model, AutoTokenizer.from_pretrained(path))


def report(results: dict[str, dict[str, Any]]) -> None:
    reached = {}
    for name, r in results.items():
        if "error" in r:
            print(f"{name}: FAILED ({r['error']}) after {r['wall_s']:.0f} s")
            continue
        hit = next((e["at_s"] for e in r["evals"] if e["accuracy"] >= TARGET), None)
        reached[name] = (r["wall_s"], hit)
        curve = ", ".join(f"step {e['step']}: {e['accuracy']:.2f} at {e['at_s']:.0f} s" for e in r["evals"])
        print(f"{name}: whole run {r['wall_s']:.1f} s; {TARGET:.0%} reached "
              f"{'never' if hit is None else f'at {hit:.1f} s'}; evaluations {curve}; "
              f"independent evaluation of the final policy {r['independent']:.2f}")
        if "spent_s" in r:
            spent = r["spent_s"]
            print("    rlops' time by stage: " + ", ".join(f"{k} {v:.1f} s" for k, v in sorted(spent.items(), key=lambda kv: -kv[1]))
                  + f", outside the stages {r['wall_s'] - sum(spent.values()):.1f} s")
    if len(reached) == 2:
        (t_wall, t_hit), (r_wall, r_hit) = reached["trl"], reached["rlops"]
        print(f"ratio TRL/rlops, whole run: {t_wall / r_wall:.2f}x"
              + (f"; time to {TARGET:.0%}: {t_hit / r_hit:.2f}x" if t_hit and r_hit else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", choices=["both", "rlops", "trl"], default="both")
    ap.add_argument("--workdir", default="/tmp/rlops-parity-vs-trl")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--trl-steps", type=int, default=STEPS, help="TRL's steps, alone (a quick check of its side)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting of rlops' run (repeatable)")
    args = ap.parse_args()
    if args.child:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        return trl_child(Path(args.child[0]), Path(args.child[1]), float(args.child[2]), args.trl_steps)
    from stages.policy.model import prepare_default_model

    prepare_default_model()  # converted once, before any timing
    work = Path(args.workdir)
    if work.exists():
        subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir(parents=True)
    sides = ["trl", "rlops"] if args.side == "both" else [args.side]
    results = {name: run_side(name, work, tuple(args.set)) for name in sides}  # one after the other, nothing beside them
    for r in results.values():
        if "error" not in r:
            r["independent"] = independent(r["adapter"])
    print(f"{os.cpu_count()} CPUs; {STEPS} steps, evaluations every {EVERY}, target {TARGET:.0%}"
          + (f"; rlops with {' '.join(args.set)}" if args.set else ""))
    report(results)
    (work / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    loopback.enter()
    main()
