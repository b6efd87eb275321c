"""Environment overhead (issue 32): one OpenEnv step over its WebSocket session against the same step
in-process, and 8 concurrent sessions against 8 sequential episodes.

    .ci/loopback .venv/bin/python bench/bench_env.py [--episodes 200] [--think-ms 20]

The environment is examples/environments/guess_env.py, served by rlops' own `AppServer` (uvicorn in a
child process on 127.0.0.1, as `task: openenv` with `app:` runs it) and driven by openenv-core's
`GenericEnvClient`; the in-process run calls `GuessEnvironment.reset/step` directly. The player is
scripted (halving), so both runs take exactly the same steps. Printed: ms per step each way and
their difference (the per-step overhead; goal <= 5 ms), then the wall time of 8 episodes played in 8
concurrent sessions against the same 8 played one after another, with `--think-ms` of policy time
per step (asyncio.sleep: what concurrency hides; 0 measures the server alone).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import loopback  # noqa: F401 - bench/loopback.py: run under .ci/loopback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.environments.guess_env import HIGH, GuessAction, GuessEnvironment  # noqa: E402
from tasks.openenv import AppServer  # noqa: E402

APP = "examples.environments.guess_env:app"


def halve(lo: int, hi: int, message: str) -> tuple[int, int]:
    """The scripted player's next interval after a reply."""
    guess = (lo + hi) // 2
    return (guess + 1, hi) if "higher" in message else (lo, guess - 1)


def in_process(seeds: list[int]) -> tuple[float, int]:
    """(seconds, steps) of playing every seed with the environment object itself."""
    steps, start = 0, time.perf_counter()
    for seed in seeds:
        env, lo, hi = GuessEnvironment(), 1, HIGH
        env.reset(seed=seed)
        while True:
            obs = env.step(GuessAction(guess=(lo + hi) // 2))
            steps += 1
            if obs.done:
                break
            lo, hi = halve(lo, hi, obs.message)
    return time.perf_counter() - start, steps


async def episode(url: str, seed: int, think_s: float) -> int:
    from openenv.core.generic_client import GenericEnvClient

    steps, lo, hi = 0, 1, HIGH
    async with GenericEnvClient(base_url=url) as env:
        await env.reset(seed=seed)
        while True:
            if think_s:
                await asyncio.sleep(think_s)
            result = await env.step({"guess": (lo + hi) // 2})
            steps += 1
            if result.done:
                return steps
            lo, hi = halve(lo, hi, result.observation["message"])


async def over_ws(url: str, seeds: list[int], think_s: float, concurrent: bool) -> tuple[float, int]:
    start = time.perf_counter()
    if concurrent:
        counts = await asyncio.gather(*(episode(url, s, think_s) for s in seeds))
    else:
        counts = [await episode(url, s, think_s) for s in seeds]
    return time.perf_counter() - start, sum(counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--think-ms", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    server = AppServer(APP)
    url = server.ensure_running()
    try:
        seeds = list(range(args.episodes))
        asyncio.run(over_ws(url, seeds[:5], 0.0, False))  # warm up: imports, first connections
        local = [in_process(seeds) for _ in range(args.repeats)]
        remote = [asyncio.run(over_ws(url, seeds, 0.0, False)) for _ in range(args.repeats)]
        ms_local = statistics.median(t / n for t, n in local) * 1e3
        ms_remote = statistics.median(t / n for t, n in remote) * 1e3
        print(f"{args.episodes} episodes, {remote[0][1]} steps; ms per step (median of {args.repeats}):")
        print(f"  in-process {ms_local:.3f}   WebSocket session {ms_remote:.3f}   overhead {ms_remote - ms_local:.3f}"
              f" (goal <= 5)")
        for think in sorted({0.0, args.think_ms}):
            seq = statistics.median(asyncio.run(over_ws(url, seeds[:8], think / 1e3, False))[0] for _ in range(args.repeats))
            par = statistics.median(asyncio.run(over_ws(url, seeds[:8], think / 1e3, True))[0] for _ in range(args.repeats))
            print(f"  8 episodes, think {think:g} ms/step: sequential {seq * 1e3:.1f} ms, 8 concurrent sessions "
                  f"{par * 1e3:.1f} ms, x{seq / par:.2f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
