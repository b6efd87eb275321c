"""Served vs in-process doc_search episodes on SmolLM2-135M-Instruct (CPU), and time to first token.

    .venv/bin/python bench/bench_serve.py [--prompts 4] [--group 8] [--max-new-tokens 48] [--rounds 2]
    .venv/bin/python bench/bench_serve.py --compare messages ...    # /v1/messages vs /v1/chat/completions

The same work both ways, through the real rollout stage worker: `prompts x group` doc_search
episodes (4 x 8 = 32 concurrent episodes) on the train split,
  - in-process: the built-in batched agent loop (stages/policy/agent_loop.py) with the task's BM25 tools;
  - served: examples/doc_search_openai/agent.py, a plain OpenAI tool-calling agent, run through the
    policy service (uvicorn on 127.0.0.1, the real openai client, requests batched by the service).
Throughput is sampled tokens (loss_mask == 1) per second of the shard's wall time; the runs
alternate, `--rounds` times each, and the ratio is taken over the summed times. Time to first
token: an idle service, one request for the opening doc_search prompt with max_tokens=1 (prefill +
HTTP + the batch window), median of `--ttft-repeats`.

`--compare messages` runs the same episodes served both ways instead: over `/v1/chat/completions`
(the OpenAI example above) and over Anthropic's `/v1/messages` (examples/frameworks/anthropic/agent.py,
the same system prompt and tools, which render to the same prompt tokens), and reports
messages / chat throughput (no time to first token).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import loopback  # bench/loopback.py: run under .ci/loopback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "doc_search_openai"
ANTHROPIC = REPO / "examples" / "frameworks" / "anthropic"


def add_shard_args(ap: argparse.ArgumentParser) -> None:
    """The arguments of a shard comparison (this script's and bench_serve_stream.py's)."""
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)


def make_workers(args: argparse.Namespace, tasks: dict) -> tuple[dict, list]:
    """One prepared rollout worker per labelled TaskSpec on the base SmolLM2, and the doc_search groups
    (`--prompts` train prompts) every worker runs."""
    import torch

    from stages.policy.model import DEFAULT_MODEL, resolve_model
    from stages.rollout import RolloutConfig, RolloutWorker
    from tasks.base import load_task

    torch.set_num_threads(args.threads)
    base = resolve_model(DEFAULT_MODEL)
    config = RolloutConfig(prompts_per_step=args.prompts, group_size=args.group, max_new_tokens=args.max_new_tokens,
                           max_total_tokens=1536, groups_per_shard=args.prompts, tool_timeout=5.0)
    groups = list(enumerate(load_task("doc_search").prompts("train")[: args.prompts]))
    workers = {label: RolloutWorker(config, base, spec) for label, spec in tasks.items()}
    for worker in workers.values():
        worker.prepare(config, "base", None)
    return workers, groups


def compare(workers: dict, groups: list, rounds: int) -> dict[str, float]:
    """Run the workers' shards alternately, `rounds` times each; print each shard and each worker's
    totals; return each worker's sampled tokens per second over its summed time."""
    import pyarrow.compute as pc

    totals = {label: [0.0, 0, 0, 0] for label in workers}  # seconds, sampled tokens, episodes, turns
    for r in range(rounds):
        for label, worker in workers.items():
            t0 = time.perf_counter()
            table = worker.run_shard(f"bench-{label}-{r}", "train", groups, base_seed=1000 * r)
            seconds = time.perf_counter() - t0
            tokens = pc.sum(pc.list_flatten(table["loss_mask"])).as_py()
            turns = pc.sum(table["num_turns"]).as_py()
            errors = pc.sum(pc.cast(pc.equal(table["finish_reason"], "error"), "int64")).as_py()
            t = totals[label]
            t[0], t[1], t[2], t[3] = t[0] + seconds, t[1] + tokens, t[2] + table.num_rows, t[3] + turns
            print(f"round {r} {label}: {table.num_rows} episodes ({errors} errors), {turns / table.num_rows:.2f} turns, "
                  f"{tokens} sampled tokens in {seconds:.1f} s = {tokens / seconds:.1f} tok/s", flush=True)
    rate = {label: t[1] / t[0] for label, t in totals.items()}
    for label, t in totals.items():
        print(f"{label}: {t[2]} episodes, {t[3] / t[2]:.2f} turns/episode, {t[1]} tokens in {t[0]:.1f} s "
              f"= {rate[label]:.1f} tok/s, {t[2] / t[0]:.2f} episodes/s")
    return rate


def main() -> None:
    ap = argparse.ArgumentParser()
    add_shard_args(ap)
    ap.add_argument("--ttft-repeats", type=int, default=5)
    ap.add_argument("--compare", choices=["in-process", "messages"], default="in-process",
                    help="what the served OpenAI agent is compared with: the in-process doc_search loop, or the "
                         "same agent written against Anthropic's Messages API (/v1/messages)")
    args = ap.parse_args()

    from stages.rollout import TaskSpec

    prompts = str(EXAMPLE / "prompts.jsonl")
    served = TaskSpec(name="agent", params={"entry": f"{EXAMPLE / 'agent.py'}:rollout", "prompts": prompts})
    if args.compare == "messages":
        baseline, ratio_of = "chat", "messages"
        tasks = {"chat": served,
                 "messages": TaskSpec(name="agent", params={"entry": f"{ANTHROPIC / 'agent.py'}:rollout", "prompts": prompts})}
    else:
        baseline, ratio_of = "in-process", "served"
        tasks = {"in-process": TaskSpec(name="doc_search", params={"max_turns": 4}), "served": served}
    workers, groups = make_workers(args, tasks)
    rate = compare(workers, groups, args.rounds)
    print(f"{ratio_of} / {baseline} throughput: {rate[ratio_of] / rate[baseline]:.3f}")
    if args.compare != "in-process":
        return
    print(f"time to first token (idle, median of {args.ttft_repeats}): {ttft(workers['served'].policy, args.ttft_repeats)}")


def ttft(policy, repeats: int) -> str:
    import openai

    from stages.policy.sampling import SamplingConfig
    from stages.service.app import ServerThread, build_app
    from stages.service.resolve import fixed_resolver
    from stages.service.service import PolicyService, ServiceConfig
    from tasks.base import render_system_prompt
    from tasks.doc_search import SYSTEM_PROMPT, TOOL_SPECS, make_task

    question = make_task().prompts("train")[0].question
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    resolve, names = fixed_resolver("base", None)
    prompt = policy.tokenizer.apply_chat_template(
        [{"role": "system", "content": render_system_prompt(SYSTEM_PROMPT, TOOL_SPECS)}, {"role": "user", "content": question}],
        tokenize=False, add_generation_prompt=True)
    ids = policy.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    times = []
    for _ in range(repeats + 1):  # the same prefill + one token, called in-process
        t0 = time.perf_counter()
        policy.generate("base", None, [ids], SamplingConfig(max_new_tokens=1))
        times.append(time.perf_counter() - t0)
    out = [f"{statistics.median(times[1:]) * 1000:.0f} ms in-process (prefill of {len(ids)} tokens + 1 token)"]
    for window in (0.05, 0.0):
        service = PolicyService(policy, resolve, ServiceConfig(batch_window_s=window), names)
        with ServerThread(build_app(service)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            times = []
            for _ in range(repeats + 1):  # the first call warms up
                t0 = time.perf_counter()
                client.chat.completions.create(model="base", messages=messages, tools=TOOL_SPECS, max_tokens=1)
                times.append(time.perf_counter() - t0)
        service.close()
        out.append(f"{statistics.median(times[1:]) * 1000:.0f} ms served with a {window * 1000:.0f} ms batch window")
    return "; ".join(out)


if __name__ == "__main__":
    loopback.enter()
    main()
