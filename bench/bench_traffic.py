"""What keeping the traffic costs (docs/LOOP.md; docs/BENCHMARKS.md, "The deployment loop"):

1. served throughput with recording on vs off: the default model served in-process (PolicyService on uvicorn, the
   real openai client), `--clients` concurrent users sending chat requests; the two settings alternate in `--reps`
   rounds (ABAB...) so the machine's drift falls on both; the ratio of their requests per second;
2. SQL over `--rows` traffic rows: written by the traffic log as `rlops serve` writes them (parts of `--flush` calls,
   merged as they accumulate), then a count, a filter by session, and a filter by a one-hour window, each through
   `rlops sql`'s locked-down sandbox (views made anew, as every `rlops sql` does), median of 5;
3. forgetting one user (10 calls) at that size: `rlops traffic forget`'s function, once.

    .ci/loopback .venv/bin/python bench/bench_traffic.py                       # all three, 1M rows
    .ci/loopback .venv/bin/python bench/bench_traffic.py --skip-serve --rows 100000
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUESTION = "What is {a} + {b}? Reply with the number only."


def machine_speed() -> str:
    tool = Path(__file__).resolve().parents[2] / "shared" / "bin" / "machine-speed"
    try:
        return subprocess.run([str(tool)], capture_output=True, text=True, timeout=120).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "machine-speed: not available"


def serve_throughput(requests: int, clients: int, reps: int, max_tokens: int) -> dict:
    """Requests per second with recording off and on, alternating; the on/off ratio of their medians."""
    import openai

    from flows.serve_commands import recording_sink
    from stages.common import base_policy
    from stages.policy.model import DEFAULT_MODEL, resolve_model
    from stages.policy.resident import ResidentPolicy
    from stages.service.app import ServerThread, build_app
    from stages.service.resolve import fixed_resolver
    from stages.service.service import PolicyService, ServiceConfig
    from storage.traffic import TrafficLog, TrafficSettings
    from storage.workspace import Workspace

    model = resolve_model(DEFAULT_MODEL)
    policy = ResidentPolicy.load(model)
    ws = Workspace.open(tempfile.mkdtemp(prefix="bench-traffic-serve-"))
    log = TrafficLog(ws, TrafficSettings())
    resolve, names = fixed_resolver("base", None)
    sink = recording_sink(log, None, 1.0, base_policy(ws, model))
    rates: dict[str, list[float]] = {"off": [], "on": []}
    counter = iter(range(1 << 30))

    def one(url: str) -> None:
        i = next(counter)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                               default_headers={"X-Episode-Id": f"ep-{i}", "X-User-Id": f"u{i % 97}"})
        client.chat.completions.create(model="base", max_tokens=max_tokens, temperature=1.0,
                                       messages=[{"role": "user", "content": QUESTION.format(a=10 + i % 89, b=i % 13)}])

    for rep in range(reps):
        for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            service = PolicyService(policy, resolve, ServiceConfig(batch_window_s=0.05), names,
                                    sink=sink if mode == "on" else None)
            try:
                with ServerThread(build_app(service, log if mode == "on" else None)) as url:
                    with ThreadPoolExecutor(clients) as pool:
                        list(pool.map(lambda _: one(url), range(clients)))  # warm: the first batches of this server
                        start = time.perf_counter()
                        list(pool.map(lambda _: one(url), range(requests)))
                        rates[mode].append(requests / (time.perf_counter() - start))
            finally:
                service.close()
            print(f"  round {rep + 1} {mode}: {rates[mode][-1]:.2f} requests/s", flush=True)
    log.close()
    kept = ws.query("SELECT count(*) AS n FROM traffic").to_pylist()[0]["n"]
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    return {"requests_per_round": requests, "clients": clients, "max_tokens": max_tokens, "rounds": reps,
            "off_rps": [round(r, 3) for r in rates["off"]], "on_rps": [round(r, 3) for r in rates["on"]],
            "ratio_on_off": round(on / off, 4), "calls_kept": kept}


def fill(ws, rows: int, flush: int) -> dict:
    """`rows` served calls through the traffic log, as a busy server would write them over 30 days: 10,000 users,
    sessions of 1-4 calls, realistic prompts (system + question) and token lists."""
    import random

    from storage.traffic import TrafficLog, TrafficSettings, content_key, input_key

    rng = random.Random(0)
    t0 = datetime(2026, 11, 1, tzinfo=timezone.utc)
    # Flushed by hand every `flush` calls below (the thread never fills up): the timing is the writer's, not a race.
    log = TrafficLog(ws, TrafficSettings(flush_calls=rows + 1, flush_seconds=3600))
    system = {"role": "system", "content": "You are the help desk of a travel company. Answer briefly and politely.",
              "tool_calls": [], "tool_call_id": None, "name": None}
    start = time.perf_counter()
    session, left = 0, 0
    for i in range(rows):
        if left == 0:
            session, left = session + 1, rng.randint(1, 4)
        left -= 1
        user = f"user-{session % 10_000}"
        text = f"Booking {rng.randrange(10**8)}: can I change my flight to {rng.choice(['Lyon', 'Oslo', 'Porto'])} " \
               f"on day {rng.randint(1, 28)}? " + "Please check the fare rules. " * rng.randint(1, 4)
        messages = [system, {"role": "user", "content": text, "tool_calls": [], "tool_call_id": None, "name": None}]
        prompt = [rng.randrange(49152) for _ in range(40 + len(text) // 4)]
        sampled = [rng.randrange(49152) for _ in range(rng.randint(8, 48))]
        log.add({"call_id": f"chatcmpl-{i:08d}", "served_at": t0 + timedelta(seconds=i * 30 * 86400 / rows),
                 "latency_s": rng.uniform(0.2, 3.0), "api": "chat", "stream": False, "episode_id": f"ep-{session}",
                 "session_id": f"s-{session}", "user_id": user, "model": "assistant@champion", "policy_id": "ck-x",
                 "registry_model": "assistant", "registry_alias": "champion", "registry_version": "3",
                 "messages": messages, "reply": "Yes, the fare allows one change.", "reply_tool_calls": 0,
                 "finish_reason": "stop", "n": 1, "prompt_token_ids": prompt, "token_ids": sampled,
                 "logprobs": [-rng.random() for _ in sampled], "prompt_tokens": len(prompt),
                 "completion_tokens": len(sampled), "sampling": '{"temperature": 1.0}', "tags": '{"app": "web"}',
                 "scenario_id": content_key(messages), "input_id": input_key(messages)})
        if (i + 1) % flush == 0:
            log.flush()
    log.close()
    seconds = time.perf_counter() - start
    files = ws.catalog.rows("SELECT count(*) AS n, sum(bytes) AS b FROM files WHERE kind = 'traffic'")[0]
    return {"rows": rows, "flush_calls": flush, "write_s": round(seconds, 1), "rows_per_s": round(rows / seconds),
            "files": files["n"], "mb": round(files["b"] / 2**20, 1)}


def sql_times(ws) -> dict:
    from storage.sql import Sandbox

    queries = {
        "count": "SELECT count(*) FROM traffic",
        "session": "SELECT call_id, served_at, reply FROM traffic WHERE session_id = 's-4242' ORDER BY served_at",
        "window": "SELECT count(*), avg(latency_s) FROM traffic WHERE served_at >= TIMESTAMPTZ '2026-11-17 10:00:00+00' "
                  "AND served_at < TIMESTAMPTZ '2026-11-17 11:00:00+00'",
    }
    out = {}
    for name, sql in queries.items():
        times = []
        for _ in range(5):
            start = time.perf_counter()
            Sandbox(ws.settings).query(sql)  # views made anew each time: what one `rlops sql` does
            times.append(time.perf_counter() - start)
        out[name] = round(statistics.median(times), 3)
    return out


def forget_time(ws) -> dict:
    from storage.forget import forget

    user = "user-4242"
    start = time.perf_counter()
    report = forget(ws, "user", user)
    return {"user_calls": report["traffic_rows"], "files_rewritten": report["files_rewritten"],
            "seconds": round(time.perf_counter() - start, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--flush", type=int, default=2000, help="calls per part (a busy server's `--flush-calls`)")
    parser.add_argument("--requests", type=int, default=48, help="requests per throughput round")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--reps", type=int, default=4, help="throughput rounds per setting")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--skip-serve", action="store_true")
    args = parser.parse_args()
    from storage.workspace import Workspace

    result = {"machine_speed": machine_speed(), "date": datetime.now(timezone.utc).isoformat(timespec="minutes")}
    if not args.skip_serve:
        print("served throughput, recording off vs on:", flush=True)
        result["serve"] = serve_throughput(args.requests, args.clients, args.reps, args.max_tokens)
        print(json.dumps(result["serve"]), flush=True)
    ws = Workspace.open(tempfile.mkdtemp(prefix="bench-traffic-sql-"))
    result["write"] = fill(ws, args.rows, args.flush)
    print(json.dumps(result["write"]), flush=True)
    result["sql_s"] = sql_times(ws)
    print(json.dumps(result["sql_s"]), flush=True)
    result["forget"] = forget_time(ws)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
