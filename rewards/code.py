"""Code rewards: the program in the final reply, run against the prompt's tests in the sandbox (sandbox/).

    score:
      rewards:
        - {name: tests, fn: rewards.code.tests_passed}                          # the fraction of tests passed
        - {name: solved, fn: rewards.code.tests_passed, params: {mode: all}}    # 1 only when every test passes

The tests come from the rollout's metadata (a dataset's columns: docs/TASKS.md, `dataset`), by kind:
- `asserts`: metadata[`tests`] is a list of assert snippets (MBPP's `test_list`), or one string of them;
- `check`: metadata[`check`] defines `check(candidate)` and metadata[`entry_point`] names the function (HumanEval);
- `io`: metadata[`cases`] is a list of `{stdin, stdout}` (or `{input, output}`) cases, the program a script;
`kind: auto` picks the first whose keys the metadata has. The program is the last fenced code block of the reply
(```python ... ``` or ``` ... ```), or the whole reply when it has none (`extract: whole`: always the whole reply);
`prepend` names a metadata field put before it (HumanEval's `prompt`: the signature and docstring).

Each program runs in this process's sandbox pool (`sandbox.shared_pool`; `score.workers > 1` spreads batches over
Ray workers, each with its own). A program that fails,
loops, crashes or misbehaves scores what its tests say (0 when none ran); its outcome, each test's, and the first
error are the row's details, so `rlops inspect` and SQL show why. A sandbox the machine cannot provide (not root)
is an error row naming the reason, never an unsandboxed run.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from rewards.builtin import final_answer
from rewards.declare import reward
from sandbox import Limits, shared_pool
from storage.schema import Rollout

FENCE_RE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
OPEN_FENCE_RE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*)\Z", re.DOTALL | re.IGNORECASE)


@reward(low=0.0, high=1.0)
def tests_passed(rollout: Rollout, mode: Literal["fraction", "all"] = "fraction",
                 kind: Literal["auto", "asserts", "check", "io"] = "auto",
                 extract: Literal["last_block", "whole"] = "last_block", prepend: str | None = None,
                 wall_seconds: float = 10.0, memory_mb: int = 512) -> tuple[float, dict[str, Any]]:
    """The fraction of its tests the reply's program passes (`mode: all`: 1 only when all pass)."""
    limits = Limits(wall_seconds=wall_seconds, test_seconds=min(5.0, wall_seconds), memory_mb=memory_mb)
    code = program_of(final_answer(rollout) or "", extract)
    if prepend is not None:
        code = f"{rollout.metadata[prepend]}\n{code}"
    result = shared_pool().run(code, limits, **tests_in(rollout.metadata, kind))
    value = result.passed if mode == "fraction" else float(result.outcome == "pass")
    first = next((t.get("error") for t in result.tests if t["outcome"] != "pass"), None) or result.error
    return value, {"outcome": result.outcome, "passed": sum(t["outcome"] == "pass" for t in result.tests),
                   "total": len(result.tests), "tests": [t["outcome"] for t in result.tests], "error": first,
                   "stderr": result.stderr[-500:] or None, "seconds": result.seconds}


def program_of(reply: str, extract: Literal["last_block", "whole"] = "last_block") -> str:
    """The program in a reply: its last fenced code block (an unclosed last fence counts: a reply cut off by the
    token limit), or the whole reply when it has none or `extract` is "whole"."""
    if extract == "whole":
        return reply
    blocks = FENCE_RE.findall(reply)
    if blocks:
        return blocks[-1]
    cut = OPEN_FENCE_RE.search(reply)
    return cut.group(1) if cut else reply


def tests_in(metadata: dict[str, Any], kind: Literal["auto", "asserts", "check", "io"] = "auto") -> dict[str, Any]:
    """The sandbox keywords (sandbox.pool.tests_of) for the tests in a prompt's metadata; KeyError naming the
    fields when there are none of the kind asked."""
    if kind in ("auto", "check") and "check" in metadata and "entry_point" in metadata:
        return {"check": metadata["check"], "entry_point": metadata["entry_point"]}
    if kind in ("auto", "check") and "test" in metadata and "entry_point" in metadata:  # HumanEval's own names
        return {"check": metadata["test"], "entry_point": metadata["entry_point"]}
    if kind in ("auto", "asserts") and "tests" in metadata:
        tests = metadata["tests"]
        return {"asserts": [tests] if isinstance(tests, str) else [str(t) for t in tests]}
    if kind in ("auto", "io") and "cases" in metadata:
        return {"cases": [{"stdin": c.get("stdin", c.get("input", "")), "stdout": c.get("stdout", c.get("output"))}
                          for c in metadata["cases"]]}
    raise KeyError(f"no {'' if kind == 'auto' else kind + ' '}tests in the metadata (looked for check + entry_point, "
                   f"test + entry_point, tests, cases; it has: {', '.join(metadata)})")
