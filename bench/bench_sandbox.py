"""Executions per second of a short program against its tests, in the sandbox (sandbox/) and the ways around it.

    .venv/bin/python bench/bench_sandbox.py [--n 300]

The program and its tests: a two-line function and three asserts. Measured, each `--n` executions:
- `python -c` (bare): a fresh interpreter runs the program and tests, no isolation at all: the floor a sandbox
  that starts a Python per execution cannot beat;
- `python -I -S -c` (bare, no site): the same without site-packages' start-up;
- sandbox, one template: `Sandbox.run`, one execution at a time (a fork of the warm template, then a PID
  namespace, its init, the program's process, one process per test);
- sandbox pool of 2 on 2 cores: `SandboxPool(2).map`, two at a time.
Reported: executions per second, milliseconds per execution, and the sandbox's overhead against the bare run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sandbox import Sandbox, SandboxPool  # noqa: E402

PROGRAM = "def add(a, b):\n    return a + b\n"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]


def timed(label: str, n: int, fn) -> float:
    t0 = time.perf_counter()
    fn()
    per = (time.perf_counter() - t0) / n
    print(f"{label:>34}: {1 / per:7.1f} /s  {per * 1000:7.2f} ms each")
    return per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=300)
    args = parser.parse_args()
    n = args.n
    script = PROGRAM + "\n".join(TESTS)
    bare = timed("python -c (no isolation)", n, lambda: [
        subprocess.run([sys.executable, "-c", script], check=True) for _ in range(n)])
    timed("python -I -S -c (no isolation)", n, lambda: [
        subprocess.run([sys.executable, "-I", "-S", "-c", script], check=True) for _ in range(n)])
    one = Sandbox()
    one.run(PROGRAM, asserts=TESTS)  # warm
    results = []
    single = timed("sandbox, one template", n, lambda: results.extend(one.run(PROGRAM, asserts=TESTS) for _ in range(n)))
    one.close()
    pool = SandboxPool(2)
    pool.map([{"program": PROGRAM, "asserts": TESTS}] * 4)
    two = timed("sandbox pool of 2", n, lambda: results.extend(pool.map([{"program": PROGRAM, "asserts": TESTS}] * n)))
    pool.close()
    assert all(r.outcome == "pass" for r in results), {r.outcome for r in results}
    print(f"overhead per execution against bare `python -c`: {1000 * (single - bare):+.2f} ms (one template); "
          f"pool of 2 / bare: {bare / two:.1f}x the executions per second")


if __name__ == "__main__":
    main()
