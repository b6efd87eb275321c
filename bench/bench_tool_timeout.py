"""Tool timeouts: how long the agent loop waits on a tool that hangs (the timing that used to be a test).

    .venv/bin/python bench/bench_tool_timeout.py [--timeout 0.5] [--hang 5] [--repeats 5]

Each repeat calls `stages.policy.agent_loop.call_tools` with one quick tool call and one call to a tool that
sleeps `--hang` seconds, under a `--timeout`; the loop should return after about the timeout, not
the hang. Printed: seconds per call (median), and that as a ratio to the timeout and to the hang.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import loopback  # bench/loopback.py: run under .ci/loopback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.policy.agent_loop import call_tools  # noqa: E402
from storage.schema import ToolCall  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, default=0.5)
    parser.add_argument("--hang", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    def hang(**_: Any) -> str:
        time.sleep(args.hang)
        return "too late"

    def quick(**_: Any) -> str:
        return "ok"

    tools = {"hang": hang, "quick": quick}
    calls = [ToolCall("c0", "quick", "{}"), ToolCall("c1", "hang", "{}")]
    seconds = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        results = call_tools(calls, tools, timeout=args.timeout)
        seconds.append(time.perf_counter() - t0)
        assert results[0].content == "ok" and "timed out" in results[1].content, results
    median = statistics.median(seconds)
    print(f"call_tools with a hung tool: {median:.3f} s per call (median of {args.repeats}), "
          f"{median / args.timeout:.2f}x the timeout ({args.timeout:g} s), {median / args.hang:.3f}x the hang ({args.hang:g} s)")


if __name__ == "__main__":
    loopback.enter()
    main()
