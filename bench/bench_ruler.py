"""RULER judge cost per group, and its agreement with `correct`, with the judge served by `rlops serve`.

    .venv/bin/python bench/bench_ruler.py [--groups 4] [--group-size 8] [--oracle 2]

1. Rollouts: the real rollout stage, SmolLM2-135M-Instruct (base) on doc_search's train split,
   `groups` x `group-size` episodes (cached in the workspace: a rerun reuses them).
2. The judge: `rlops serve --base-model SmolLM2-135M-Instruct` started as its own process on
   127.0.0.1 (a free port), exactly as configs/doc_search_ruler.yaml documents for a local run.
3. Scoring: the score stage with that config's rewards (the judge pointed at the server; every row
   stored, errors included, so `max_error_fraction` is 1 here), the judge cache emptied first so
   every group is really judged. The config's `score.workers` groups are judged at once (the server
   batches their requests), so seconds per group is the scoring's wall time over the groups.
4. Per group: requests (a reply that is not valid scores JSON gets one correction retry), prompt
   and completion tokens (from the rows' `group_usage`), and whether the judge produced scores.
5. Agreement: rewards.agreement.AGREEMENT_SQL (the query docs/REWARDS.md shows) over the workspace.

The base model is near 0 % correct, so its groups have few pairs that `correct` orders. `--oracle K`
also scores a second workspace whose groups are the same rollouts with K of each group's episodes
replaced by the task's scripted oracle episode (search, read, right answer): pairs the judge should
order, whatever a 135M model does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import loopback  # bench/loopback.py: run under .ci/loopback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "doc_search_ruler.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_judge(workspace: Path, model: str, port: int) -> subprocess.Popen:
    """`rlops serve` as the config documents it; returns once /v1/models answers."""
    log = open(workspace / "judge-serve.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--workspace", str(workspace / "judge-ws"),
                             "--base-model", model, "--port", str(port)],
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log, stderr=subprocess.STDOUT)
    return answering(proc, f"http://127.0.0.1:{port}/v1/models", f"rlops serve did not start; see {log.name}")


def answering(proc: subprocess.Popen, url: str, failure: str, timeout: float = 300) -> subprocess.Popen:
    """`proc` once `url` answers 200; killed, and RuntimeError(`failure`), if it exits or does not answer in time."""
    import httpx

    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(failure)
        time.sleep(0.5)


def run_config(args: argparse.Namespace, base_url: str) -> Any:
    """configs/doc_search_ruler.yaml at the bench's size, the judge at `base_url`, every row kept."""
    from flows.config import read_yaml
    from flows.run_config import from_dict, semantic_problems

    data = read_yaml(CONFIG)
    data["rollout"].update(prompts_per_step=args.groups, group_size=args.group_size, max_new_tokens=args.max_new_tokens)
    data["score"]["max_error_fraction"] = 1.0
    (ruler,) = [r for r in data["score"]["rewards"] if r["name"] == "ruler"]
    ruler["params"].update(base_url=base_url, max_tokens=args.judge_max_tokens)
    cfg = from_dict(data)
    problems = semantic_problems(cfg)
    if problems:
        raise SystemExit(f"config problems: {problems}")
    return cfg


def oracle_mix(src: Any, dst: Any, batch: str, k: int, task_spec: Any) -> str:
    """Copy `batch` into workspace `dst` with the first k episodes of each group replaced by the
    task's oracle episode for its prompt (same ids, group and sampling; the messages are the oracle's)."""
    from storage.schema import Message, Rollout, ToolCall, from_table, to_table
    from tasks.base import load_task
    from tasks.doc_search import oracle_messages

    task = load_task(task_spec.name, task_spec.params)
    prompts = {p.prompt_id: p for p in task.prompts("train")}
    mixed = batch + "-oracle"
    if dst.catalog.get_artifact(mixed) is not None:
        return mixed  # made by an earlier run
    rollouts = from_table(src.read_artifact(batch), Rollout)
    out = []
    for r in rollouts:
        r.batch_id = mixed
        if r.sample_idx < k:
            msgs = [Message(m["role"], m.get("content"), [ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
                                                            for c in m.get("tool_calls", [])],
                            m.get("tool_call_id"), m.get("name"))
                    for m in oracle_messages(task, prompts[r.prompt_id])]
            r.messages, r.num_turns, r.num_tool_calls, r.finish_reason = msgs, 3, 2, "answer"
        out.append(r)
    dst.write_part("rollouts", mixed, to_table(out), part="part-0")
    dst.catalog.complete_artifact(mixed, "rollouts", "rollout", [], "oracle-mix")
    return mixed


class CallLog:
    """Every judge HTTP call of this process: seconds, tokens and the reply. Failed groups keep no
    `group_usage` in their rows (the JudgeError replaces the values), so their cost is only seen here.

    Wraps `complete` on the shared client instance that ruler_reward gets from make_client (one per
    judge config), not on the class: the class's code is part of the reward's version."""

    def __init__(self, params: dict[str, Any]) -> None:
        from dataclasses import fields

        from rewards.ruler import JudgeConfig, make_client

        names = {f.name for f in fields(JudgeConfig)}
        self.client = make_client(JudgeConfig(**{k: v for k, v in params.items() if k in names}))
        self.calls: list[dict[str, Any]] = []
        orig = self.client.complete

        def complete(messages: list[dict[str, Any]], response_format: dict[str, Any] | None = None) -> Any:
            t0 = time.perf_counter()
            out = orig(messages, response_format=response_format)
            self.calls.append({"seconds": time.perf_counter() - t0, "prompt_tokens": out.prompt_tokens,
                               "completion_tokens": out.completion_tokens, "reply": out.content})
            return out

        self.client.complete = complete

    def close(self) -> None:
        del self.client.complete  # the class's method again


def judge_and_report(label: str, ws: Any, cfg: Any, batch: str) -> None:
    """Score `batch` with a cold judge cache; print cost per group and agreement."""
    from rewards.agreement import AGREEMENT_SQL
    from stages import score
    from stages.common import StageContext
    from stages.reward_ref import RewardRef

    shutil.rmtree(ws.judge_cache_dir, ignore_errors=True)
    (spec,) = [r for r in cfg.score.rewards if r.name == "ruler"]
    calls = CallLog(spec.params)
    t0 = time.perf_counter()
    try:
        score.run(cfg.score, StageContext(ws, run_name="bench-ruler", force=True), [batch])
    finally:
        calls.close()
    seconds = time.perf_counter() - t0
    ruler = RewardRef.configured(cfg.score, "ruler")
    groups = ws.query("""
        SELECT ro.group_id, count(*) AS n, count(*) FILTER (WHERE w.value IS NULL) AS errors,
               any_value(w.error) AS error, any_value(w.details->'group_usage'->>'requests') AS requests,
               sum(c.value) AS correct, list(round(w.value, 2) ORDER BY ro.sample_idx) AS scores
        FROM rollouts ro JOIN rewards w ON w.rollout_id = ro.rollout_id AND w.reward_name = $name AND w.reward_version = $v
        JOIN rewards c ON c.rollout_id = ro.rollout_id AND c.reward_name = 'correct'
        WHERE ro.batch_id = $batch GROUP BY ro.group_id ORDER BY ro.group_id""",
        {"name": ruler.name, "v": ruler.version, "batch": batch}).to_pylist()
    n, c = len(groups), calls.calls
    if not c:
        raise RuntimeError("the judge received no request through the bench's client: its config differs from the reward's")
    print(f"\n== {label}: batch {batch}, {n} groups, ruler@{ruler.version}, score stage {seconds:.1f} s")
    for g in groups:
        verdict = f"error: {g['error'][:120]}" if g["errors"] == g["n"] else f"scores {g['scores']} ({g['requests']} requests)"
        print(f"  {g['group_id']}: correct {int(g['correct'])}/{g['n']}, {verdict}")
    ok = sum(g["errors"] < g["n"] for g in groups)
    print(f"  groups scored: {ok}/{n}; judge requests: {len(c)} ({len(c) / n:.2f} per group)")
    print(f"  per group: {seconds / n:.1f} s, prompt tokens {sum(x['prompt_tokens'] for x in c) / n:.0f}, "
          f"completion tokens {sum(x['completion_tokens'] for x in c) / n:.0f}")
    print(f"  per request: {sum(x['seconds'] for x in c) / len(c):.1f} s, "
          f"max prompt {max(x['prompt_tokens'] for x in c)} tokens, max completion {max(x['completion_tokens'] for x in c)}")
    print(f"  a first reply: {c[0]['reply'][:300]!r}")
    (agreement,) = ws.query(AGREEMENT_SQL).to_pylist()
    print(f"  agreement: {agreement}")
    replies = ws.root / "judge-replies.jsonl"
    replies.write_text("".join(json.dumps(x) + "\n" for x in c))
    print(f"  every reply: {replies}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workspace", default="/tmp/rlops-bench-ruler")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48, help="per policy turn in the rollouts")
    ap.add_argument("--judge-max-tokens", type=int, default=512)
    ap.add_argument("--judge-model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--oracle", type=int, default=0, help="also judge groups with K oracle episodes each")
    args = ap.parse_args()

    from stages import rollout
    from stages.common import StageContext, base_policy
    from storage.workspace import Workspace

    root = Path(args.workspace)
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cfg = run_config(args, f"http://127.0.0.1:{port}/v1")
    ws = Workspace.open(root / "ws")
    ctx = StageContext(ws, run_name="bench-ruler")
    t0 = time.perf_counter()
    batch = rollout.run(cfg.rollout, ctx, policy_id=base_policy(ws, cfg.base_model), task=cfg.task, split="train", step=0)
    print(f"rollouts: {batch.id} ({'cached' if batch.cached else 'generated'}) in {time.perf_counter() - t0:.1f} s")

    t0 = time.perf_counter()
    judge = start_judge(root, args.judge_model, port)
    print(f"judge: rlops serve --base-model {args.judge_model} on port {port}, ready in {time.perf_counter() - t0:.1f} s "
          f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})")
    try:
        judge_and_report("base rollouts", ws, cfg, batch.id)
        if args.oracle:
            mixed_ws = Workspace.open(root / f"ws-oracle{args.oracle}")
            mixed = oracle_mix(ws, mixed_ws, batch.id, args.oracle, cfg.task)
            judge_and_report(f"{args.oracle} oracle episodes per group", mixed_ws, cfg, mixed)
    finally:
        judge.terminate()
        judge.wait(timeout=60)


if __name__ == "__main__":
    loopback.enter()
    main()
