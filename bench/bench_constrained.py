"""Constrained decoding and top log-probs: what they cost the HF backend's generation.

SmolLM2-135M-Instruct on CPU, doc_search prompts (its system prompt with the two tools), one
`HFBackend.generate` call of B rows (default 16), T=1.0, up to N new tokens (default 48), seeded.
Five settings, interleaved over the reps (median):

    free              no per-row options: the path every rollout takes (no masker, no top-k)
    tool_choice       every row constrained to one doc_search tool call (`tool_choice: "required"`)
    json_schema       every row constrained to a small answer schema (`response_format: json_schema`)
    half              half the rows tool_choice-constrained, half free, in one call
    top_logprobs=20   every row asks for the 20 most likely tokens per step

Tokens/s counts sampled tokens (EOS included). A constrained row ends when its grammar does, so
its turns are shorter: tokens/s, not seconds per call, is the comparable figure. `mask share` is
the time inside the grammar masker (llguidance's per-row masks on CPU, their application) over the
call's time.

    .venv/bin/python bench/bench_constrained.py [--rows 16] [--new-tokens 48] [--reps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import loopback  # bench/loopback.py: run under .ci/loopback

ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40},
                                           "year": {"type": "integer", "minimum": 1000, "maximum": 2100}},
          "required": ["answer", "year"], "additionalProperties": False}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from stages.policy import constrain
    from stages.policy.chat import ChatFormat
    from stages.policy.constrain import json_constraint, tool_call_constraint
    from stages.policy.hf import HFBackend
    from stages.policy.load import load_policy
    from stages.policy.sampling import RowOptions, SamplingConfig
    from storage.schema import Message
    from tasks.base import load_task, parse_tool_calls
    from tasks.doc_search import TOOL_SPECS

    torch.set_num_threads(args.threads)
    model, tokenizer = load_policy("SmolLM2-135M-Instruct", device="cpu")
    task = load_task("doc_search")
    chat = ChatFormat(tokenizer)
    questions = task.prompts("train")[: args.rows]
    # The task's opening messages: its system prompt with the two tools in the `<tool_call>` format.
    prompts = [chat.encode(chat.render([Message(m["role"], m["content"]) for m in task.messages(p)], True))
               for p in questions]
    prompts = (prompts * args.rows)[: args.rows]
    backend = HFBackend(model, tokenizer)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.new_tokens)

    calls = tool_call_constraint(TOOL_SPECS, only=None, parallel=False, label="tool_choice=required")
    answer = json_constraint(ANSWER, label="response_format=json_schema")
    n = len(prompts)
    settings: dict[str, list[RowOptions] | None] = {
        "free": None,
        "tool_choice": [RowOptions(constraint=calls)] * n,
        "json_schema": [RowOptions(constraint=answer)] * n,
        "half": [RowOptions(constraint=calls) if i % 2 == 0 else RowOptions() for i in range(n)],
        "top_logprobs=20": [RowOptions(top_logprobs=20)] * n,
    }

    masking = {"s": 0.0}

    def timed(fn: Callable) -> Callable:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                masking["s"] += time.perf_counter() - t0

        return wrapper

    constrain.GrammarMasker.__call__ = timed(constrain.GrammarMasker.__call__)
    for rows in settings.values():  # warm-up: lazy imports, llguidance's tokenizer, grammar compiles
        backend.generate(prompts[:2], SamplingConfig(max_new_tokens=4), seed=0, rows=rows[:2] if rows else None)

    wall: dict[str, list[float]] = {k: [] for k in settings}
    cpu: dict[str, list[float]] = {k: [] for k in settings}
    share: dict[str, list[float]] = {k: [] for k in settings}
    valid: dict[str, list[float]] = {k: [] for k in settings}
    for rep in range(args.reps):  # interleaved, so drift in machine load hits every setting alike
        for name, rows in settings.items():
            masking["s"] = 0.0
            t0, c0 = time.perf_counter(), time.process_time()
            samples = backend.generate(prompts, sampling, seed=rep, rows=rows)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            tokens = sum(len(s.token_ids) for s in samples)
            wall[name].append(tokens / dt)
            cpu[name].append(tokens / dc)
            share[name].append(masking["s"] / dt)
            ok = [bool(parse_tool_calls(s.text, 0)) and s.finish_reason == "stop" for s in samples]
            valid[name].append(sum(ok) / len(ok))

    print(f"SmolLM2-135M-Instruct, CPU, {torch.get_num_threads()} threads, {n} rows (doc_search prompts), "
          f"{args.new_tokens} new tokens max, T=1.0, {args.reps} reps (median)")
    base_wall, base_cpu = statistics.median(wall["free"]), statistics.median(cpu["free"])
    for name in settings:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        print(f"  {name:16s} {w:7.1f} tok/s wall ({w / base_wall:5.2f}x free)  {c:7.1f} tok/s cpu ({c / base_cpu:5.2f}x)  "
              f"mask share {100 * statistics.median(share[name]):5.1f}%  complete tool calls {100 * statistics.median(valid[name]):5.1f}%  "
              f"runs: {', '.join(f'{v:.1f}' for v in wall[name])}")


if __name__ == "__main__":
    loopback.enter()
    main()
