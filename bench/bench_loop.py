"""Does the deployment loop learn? A simulated user population, served, judged without labels, nightly (docs/LOOP.md).

Each day `--users` simulated users (sessions of 1-2 questions each) ask two-digit additions of the deployed agent
through `rlops serve --policy loop@champion --fallback base` (the real openai client, the arithmetic task's system
prompt, sampled at the server's defaults), and a third of them send feedback on their answers (1 when right: only
the simulator knows the sums). Then `rlops night` trains on that day's traffic: RULER without a reference
(`--mode`, yes_no by default) served by `rlops serve` on `--judge` (the largest instruct model this machine's
package index has: `make bench-judge-qwen` prepares Qwen2.5-Coder-1.5B-Instruct), gated by the same judge
(`--gate-mode`: each answer judged alone, yes_no, by default; or pairwise in both orders).
After each night the champion and the base answer the arithmetic task's 100 held-out questions greedily (never sent
to the server, never shown to the loop), scored by the sum; the table gives each night's held-out accuracy with the
paired bootstrap interval against the base (and the night's challenger's, promoted or not), the gate's decision and
win rate, the users' feedback, and seconds.

    .ci/loopback .venv/bin/python bench/bench_loop.py --nights 3
    .ci/loopback .venv/bin/python bench/bench_loop.py --nights 2 --judge SmolLM2-135M-Instruct --steps 2   # smoke
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_traffic import machine_speed  # noqa: E402

SYSTEM = "Solve the arithmetic problem. Reply with the number only, no words or working."  # tasks/arithmetic.py's
NAME = "loop"


def started(argv: list[str], url: str, log: Path, timeout: float = 900) -> subprocess.Popen:
    import httpx

    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{argv[3:6]} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{argv[3:6]} did not answer in {timeout} s")
        time.sleep(1)


def held_out() -> set[str]:
    from tasks.base import load_task

    return {p.question for p in load_task("arithmetic", {"digits": 2, "operators": "+", "n_test": 100}).prompts("test")}


def day(url: str, day_no: int, users: int, hidden: set[str]) -> dict[str, Any]:
    """One day of traffic: each user a session of 1-2 questions; a third send feedback. Returns what they saw."""
    import httpx
    import openai

    rng = random.Random(day_no)
    right = asked = said = 0
    for u in range(users):
        session = f"d{day_no}-u{u}"
        for q in range(rng.randint(1, 2)):
            while (question := f"What is {rng.randint(10, 99)} + {rng.randint(10, 99)}?") in hidden:
                pass
            a, b = (int(x) for x in question[8:-1].split(" + "))
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=2, timeout=600, default_headers={
                "X-Episode-Id": f"{session}-q{q}", "X-Session-Id": session, "X-User-Id": f"user-{u}"})
            reply = client.chat.completions.create(model=f"{NAME}@champion", max_tokens=32, messages=[
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]).choices[0].message.content
            numbers = [t for t in (reply or "").replace(",", " ").split() if t.strip(".").lstrip("-").isdigit()]
            ok = bool(numbers) and int(numbers[-1].strip(".")) == a + b
            right, asked = right + ok, asked + 1
            if u % 3 == 0:
                httpx.post(f"{url}/rlops/episodes/{session}-q{q}/feedback",
                           json={"score": float(ok), "key": "correct", "who": f"user-{u}"}, timeout=60)
                said += 1
    return {"calls": asked, "served_right": right / asked, "feedback": said}


def night(config: Path, ws: Path, log: Path) -> dict[str, Any]:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "flows.cli", "night", str(config), "--workspace", str(ws), "--json"],
                         capture_output=True, text=True)
    log.write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        raise RuntimeError(f"the night failed: {out.stderr[-3000:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "wall_s": round(time.perf_counter() - start, 1)}


def held_out_accuracy(ws_dir: Path, policies: list[str]) -> dict[str, Any]:
    """Each policy's greedy accuracy on the arithmetic task's 100 held-out questions (the `correct` reward), and each
    against the base by the paired bootstrap of `rlops eval compare`."""
    from stages import evaluate
    from stages.common import StageContext
    from stages.evaluate import EvalConfig
    from stages.rollout import RolloutConfig, TaskSpec
    from stages.score import ScoreConfig
    from storage.workspace import Workspace

    ws = Workspace.open(ws_dir)
    ctx = StageContext(ws, run_name="held-out")
    task = TaskSpec(name="arithmetic", params={"digits": 2, "operators": "+", "n_test": 100})
    score = ScoreConfig.model_validate({"rewards": [{"name": "correct", "fn": "rewards.builtin.numeric_match"}]})
    rollout = RolloutConfig(max_new_tokens=32, max_total_tokens=160)
    config = EvalConfig(split="test", n_prompts=100, metric="correct")
    metas = {p: ws.catalog.get_artifact(evaluate.run(config, ctx, p, task, rollout, score).id)["meta"] for p in policies}
    base = metas[policies[0]]
    out = {}
    for p, meta in metas.items():
        c = evaluate.paired(ws, base, meta)
        out[p] = {"accuracy": round(c.accuracy_b, 3), "vs_base": [round(c.difference, 3), round(c.low, 3), round(c.high, 3)]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nights", type=int, default=3)
    parser.add_argument("--users", type=int, default=48, help="users a day")
    parser.add_argument("--steps", type=int, default=8, help="GRPO steps a night")
    parser.add_argument("--judge", default="$RLOPS_CACHE/models/Qwen2.5-Coder-1.5B-Instruct")
    parser.add_argument("--mode", default="yes_no", help="the RULER reward's judge mode")
    parser.add_argument("--gate-mode", default="yes_no", choices=["pairwise", "yes_no"], help="the gate judge's mode")
    parser.add_argument("--workspace", help="default: a new temporary folder")
    args = parser.parse_args()
    from storage.settings import expand_cache
    from tests.processes import free_port

    ws = Path(args.workspace or tempfile.mkdtemp(prefix="bench-loop-"))
    logs = ws / "logs-bench"
    logs.mkdir(parents=True, exist_ok=True)
    judge_port, serve_port = free_port(), free_port()
    judge_url, url = f"http://127.0.0.1:{judge_port}", f"http://127.0.0.1:{serve_port}"
    judge_model = expand_cache(args.judge)
    weights = judge_model  # what the judge serves enters the reward's and the gate's versions (hashed once a process)
    cfg = {
        "name": NAME, "base_model": "SmolLM2-135M-Instruct", "steps": args.steps,
        "task": {"name": "traffic", "params": {"test_fraction": 0.25}},
        "rollout": {"prompts_per_step": 4, "group_size": 8, "max_new_tokens": 32, "max_total_tokens": 160},
        "score": {"rewards": [{"name": "ruler", "fn": "rewards.ruler.ruler_reward", "params": {
            "base_url": judge_url + "/v1", "model": "base", "mode": args.mode, "weights": weights, "timeout": 900}}],
            "total": None, "workers": 4},
        "train_reward": "ruler",
        "grpo": {"lr": 1e-4, "micro_batch_size": 8, "step_without_signal": True, "activation_checkpointing": False,
                 "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}},
        "eval": {"n_prompts": 16, "every": args.steps},
        "promote": {"judge": {"base_url": judge_url + "/v1", "model": "base", "weights": weights, "mode": args.gate_mode,
                              "timeout": 900}},
    }
    config = ws / "loop.yaml"
    config.write_text(yaml.safe_dump(cfg))
    result: dict[str, Any] = {"machine_speed": machine_speed(), "judge": judge_model, "mode": args.mode,
                              "gate_mode": args.gate_mode,
                              "users_per_day": args.users, "steps_per_night": args.steps, "nights": []}
    print(json.dumps({k: v for k, v in result.items() if k != "nights"}), flush=True)
    py = [sys.executable, "-m", "flows.cli", "serve"]
    judge = started(py + ["--policy", "base", "--base-model", judge_model, "--port", str(judge_port), "--record", "off",
                          "--workspace", str(ws / "judge-ws")], judge_url, logs / "judge.log")
    server = started(py + ["--policy", f"{NAME}@champion", "--fallback", "base", "--port", str(serve_port),
                           "--flush-calls", "16", "--workspace", str(ws)], url, logs / "serve.log")
    hidden = held_out()
    policies: list[str] = []
    try:
        for n in range(1, args.nights + 1):
            t0 = time.perf_counter()
            served = day(url, n, args.users, hidden)
            served["day_s"] = round(time.perf_counter() - t0, 1)
            time.sleep(6)  # the server's flush interval (5 s): the day's last calls are in the files
            made = night(config, ws, logs / f"night-{n}.log")
            row = {"night": n, **served, **{k: made.get(k) for k in ("night_id", "status", "calls", "scenarios_train",
                                                                    "scenarios_heldout", "start_policy", "final_policy",
                                                                    "promoted", "seconds")}, "night_wall_s": made["wall_s"]}
            promotion = ws_query(ws, "SELECT reason, challenger_value AS win_rate, low, high FROM promotions "
                                     "WHERE promotion_id = ?", [made.get("promotion_id")])
            row["gate"] = promotion[0] if promotion else None
            champion = ws_query(ws, "SELECT challenger FROM promotions WHERE promoted ORDER BY decided_at DESC LIMIT 1", [])
            row["champion"] = champion[0]["challenger"] if champion else made["start_policy"]
            if not policies:
                policies.append(made["start_policy"])  # the base model: what served the first day
            # the base first (what the others are compared with); evaluations made once are found, not made again
            measured = held_out_accuracy(ws, list(dict.fromkeys([*policies, row["champion"], made["final_policy"]])))
            row["held_out"] = measured[row["champion"]]  # what serves now
            row["challenger_held_out"] = measured[made["final_policy"]]  # what the night trained, promoted or not
            result["nights"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        for proc in (server, judge):
            proc.terminate()
            proc.wait(timeout=120)
    print(json.dumps(result, indent=1, default=str))


def ws_query(ws: Path, sql: str, params: list) -> list[dict[str, Any]]:
    from storage.workspace import Workspace

    return Workspace.open(ws).query(sql, params).to_pylist()


if __name__ == "__main__":
    main()
