"""Orchestration overhead: a 5-step tiny-model pipeline through the Prefect flow vs calling the stage
functions directly in one process (each in a fresh workspace, so nothing is cached).

    .venv/bin/python bench/bench_orchestration.py [--steps 5] [--repeats 2]

The Prefect server is started before timing (a running `prefect server`, or here the test harness's
temporary one); its one-time start is reported separately. Runs alternate direct/flow so that machine
noise hits both alike; the ratio of medians is the figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import loopback  # bench/loopback.py: run under .ci/loopback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def tiny_model(folder: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from stages.policy.model import prepare_default_model

    tok = AutoTokenizer.from_pretrained(prepare_default_model())
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def config(model: Path, steps: int) -> dict:
    return {
        "name": "orchestration", "base_model": str(model), "steps": steps,
        "task": {"name": "arithmetic", "params": {"n_train": 100, "n_test": 8}},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 16, "max_total_tokens": 128},
        "score": {"rewards": [{"name": "correct", "fn": "rewards.builtin.numeric_match"}]},
        "eval": {"n_prompts": 8, "every": steps, "metric": "correct"},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rlops-orch-"))
    os.environ["PREFECT_HOME"] = str(root / "prefect")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    (root / "prefect").mkdir()
    cfg = config(tiny_model(root / "tiny"), args.steps)

    from prefect.testing.utilities import prefect_test_harness

    from flows import pipeline
    from flows.prefect_flows import run_here, train_flow
    from flows.run_config import from_dict
    from stages.common import StageContext
    from storage.workspace import Workspace

    def direct(i: int) -> float:
        ws = Workspace.open(root / f"direct-{i}")
        ws.tracker  # MLflow DB creation is a one-time cost outside both timings
        t0 = time.perf_counter()
        cfg_obj = from_dict(cfg)
        parent = ws.tracker.start_run("pipeline:orchestration")
        pipeline.train(cfg_obj, StageContext(ws, run_name="orchestration", parent_run_id=parent), on_step=lambda r: None)
        ws.tracker.end_run(parent)
        return time.perf_counter() - t0

    def flow(i: int) -> float:
        ws = Workspace.open(root / f"flow-{i}")
        ws.tracker
        t0 = time.perf_counter()
        run_here(train_flow, cfg, str(ws.root))  # as `rlops run` calls it
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    with prefect_test_harness(server_startup_timeout=300):
        server_start = time.perf_counter() - t0
        direct(-1)  # warm-up: imports, first model load
        d, f = [], []
        for i in range(args.repeats):
            d.append(direct(i))
            f.append(flow(i))
    md, mf = statistics.median(d), statistics.median(f)
    print(f"{args.steps}-step tiny-model pipeline (evals at start and end), {args.repeats} runs each:")
    print(f"  direct stage calls: median {md:.1f} s  runs {[round(x, 1) for x in d]}")
    print(f"  Prefect flow:       median {mf:.1f} s  runs {[round(x, 1) for x in f]}")
    print(f"  flow / direct: {mf / md:.3f}  (extra wall time {100 * (mf / md - 1):+.1f} %)")
    print(f"  one-time temporary Prefect server start (not included above): {server_start:.1f} s")


if __name__ == "__main__":
    loopback.enter()
    main()
