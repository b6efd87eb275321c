"""What runs inside an execution, as the sandbox's uid: the program, then each test in a process of its own.

Test kinds (the request's `tests`):
- `{"kind": "asserts", "asserts": ["assert f(1) == 2", ...]}`: each snippet runs against the program's globals;
- `{"kind": "check", "check": "def check(candidate): ...", "entry_point": "f"}`: HumanEval's form, one test
  `check(f)`;
- `{"kind": "io", "cases": [{"stdin": "1 2\\n", "stdout": "3\\n"}, ...]}`: the program runs as `__main__` once per
  case with that input; its output must equal the expected one (trailing spaces and blank lines ignored);
- `{"kind": "run"}`: the program runs once as `__main__` (the `python` tool); its output is the result.

The program is loaded once; each test runs in a forked process, so a test that loops, crashes, exits or eats
memory costs that test only. Each outcome is reported as a record on the result pipe, prefixed with the
execution's nonce: a program that prints, or exits before the tests ran, reports nothing in its name.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

MAX_ERROR = 500  # characters of a test's error kept in its record
CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT, signal.SIGSYS}


class OutputLimit(Exception):
    """The program wrote more than its output limit."""


class CappedText(io.TextIOBase):
    """A text sink that keeps at most `limit` characters and raises OutputLimit past it."""

    def __init__(self, limit: int) -> None:
        self.parts: list[str] = []
        self.size, self.limit = 0, limit

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.size += len(s)
        if self.size > self.limit:
            raise OutputLimit(f"more than {self.limit} characters of output")
        self.parts.append(s)
        return len(s)

    def getvalue(self) -> str:
        return "".join(self.parts)


class Kit(NamedTuple):
    """What the harness calls once the program has run, bound before it runs (a tuple: not reassignable), so a
    program that replaces `builtins.exec`, `AssertionError`, `os.fork` or `json.dumps` changes nothing here."""

    exec: Callable[..., Any]
    compile: Callable[..., Any]
    dict: type
    assertion: type
    fork: Callable[[], int]
    pipe: Callable[[], tuple[int, int]]
    read: Callable[[int, int], bytes]
    write: Callable[[int, bytes], int]
    close: Callable[[int], None]
    exit: Callable[[int], None]
    kill: Callable[[int, int], None]
    waitpid: Callable[[int, int], tuple[int, int]]
    select: Callable[..., Any]
    dumps: Callable[..., str]
    loads: Callable[..., Any]
    monotonic: Callable[[], float]


def kit() -> Kit:
    return Kit(exec, compile, dict, AssertionError, os.fork, os.pipe, os.read, os.write, os.close, os._exit,
               os.kill, os.waitpid, select.select, json.dumps, json.loads, time.monotonic)


def run(request: dict[str, Any], report: Callable[[dict[str, Any]], None]) -> None:
    """Run the request's program and tests, reporting each outcome."""
    k = kit()
    program, tests, limits = request["program"], request["tests"], request["limits"]
    kind = tests["kind"]
    if kind == "run":
        report({"run": _run_main(program, "", limits["output_chars"], echo=True)})
        return
    if kind == "io":
        for i, case in enumerate(tests["cases"]):
            report({"test": i, **_forked(k, lambda c=case: _io_case(program, c, limits["output_chars"]),
                                           limits["test_seconds"])})
        return
    namespace: dict[str, Any] = {"__name__": "__sandbox__", "__builtins__": builtins}
    try:
        k.exec(k.compile(program, "<program>", "exec"), namespace)  # noqa: S102 - running it is the point
    except SystemExit as e:
        report({"load": "exit", "error": f"the program exited while loading (SystemExit({e.code!r}))"})
        return
    except BaseException as e:  # noqa: BLE001 - any failure to load is the program's, reported as data
        report({"load": _kind_of(e), "error": _describe(e)})
        return
    report({"load": "ok"})
    if kind == "check":
        snippets = [f"{tests['check']}\ncheck({tests['entry_point']})"]
    else:
        snippets = list(tests["asserts"])
    codes = [k.compile(snippet, f"<test {i}>", "exec") for i, snippet in enumerate(snippets)]
    for i, code in enumerate(codes):
        report({"test": i, **_forked(k, lambda c=code: k.exec(c, k.dict(namespace)), limits["test_seconds"])})


def _forked(k: Kit, fn: Callable[[], Any], seconds: float) -> dict[str, Any]:
    """Run `fn` in a child process: its outcome (pass, fail, error, exit, memory, output, timeout, crash,
    killed) and error text."""
    r, w = k.pipe()
    _flush()
    pid = k.fork()
    if pid == 0:
        k.close(r)
        try:
            extra = fn()
            out: dict[str, Any] = {"outcome": "pass", **(extra if isinstance(extra, k.dict) else {})}
        except k.assertion as e:
            out = {"outcome": "fail", "error": _describe(e)}
        except SystemExit as e:
            out = {"outcome": "exit", "error": f"SystemExit({e.code!r}) during the test"}
        except BaseException as e:  # noqa: BLE001
            out = {"outcome": _kind_of(e), "error": _describe(e)}
        try:
            k.write(w, k.dumps(out, default=str).encode())
        finally:
            _flush()
            k.exit(0)
    k.close(w)
    data, deadline, timed_out = b"", k.monotonic() + seconds, False
    while True:
        left = deadline - k.monotonic()
        if left <= 0:
            timed_out = True
            k.kill(pid, signal.SIGKILL)
            break
        ready, _, _ = k.select([r], [], [], left)
        if ready:
            chunk = k.read(r, 65536)
            if not chunk:
                break
            data += chunk
    k.close(r)
    _, status = k.waitpid(pid, 0)
    if timed_out:
        return {"outcome": "timeout", "error": f"over {seconds:g} s"}
    if data and os.WIFEXITED(status):
        try:
            return k.loads(data)
        except ValueError:
            pass
    return status_outcome(status, "the test")


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a stream the program replaced or closed: nothing to flush
            pass


def status_outcome(status: int, what: str) -> dict[str, Any]:
    """The outcome of a process that ended without reporting, from its wait status."""
    if os.WIFEXITED(status):
        return {"outcome": "exit", "error": f"{what} ended the process (exit code {os.WEXITSTATUS(status)})"}
    sig = os.WTERMSIG(status)
    name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
    if sig == signal.SIGXCPU:
        return {"outcome": "timeout", "error": f"{what} used up its CPU time ({name})"}
    if sig == signal.SIGXFSZ:
        return {"outcome": "output", "error": f"{what} wrote past the file-size limit ({name})"}
    if sig in CRASH_SIGNALS:
        return {"outcome": "crash", "error": f"{what} crashed ({name})"}
    return {"outcome": "killed", "error": f"{what} was killed ({name})"}


def _io_case(program: str, case: dict[str, str], output_chars: int) -> dict[str, Any]:
    got = _run_main(program, case.get("stdin", ""), output_chars, echo=False)
    if got["error"] is not None:
        raise RuntimeError(got["error"])
    expected, actual = _lines(case["stdout"]), _lines(got["stdout"])
    assert actual == expected, f"expected {case['stdout'][:200]!r}, got {got['stdout'][:200]!r}"
    return {}


def _run_main(program: str, stdin: str, output_chars: int, echo: bool) -> dict[str, Any]:
    """Run `program` as `__main__` with `stdin`; its output (at most `output_chars`), and the error that ended
    it (None when it finished, or exited with code 0)."""
    out = CappedText(output_chars)
    saved = sys.stdin, sys.stdout, sys.stderr
    sys.stdin, sys.stdout, sys.stderr = io.StringIO(stdin), out, out
    error = None
    try:
        exec(compile(program, "<program>", "exec"), {"__name__": "__main__", "__builtins__": builtins})  # noqa: S102
    except SystemExit as e:
        error = None if e.code in (None, 0) else f"SystemExit({e.code!r})"
    except OutputLimit as e:
        error = f"OutputLimit: {e}"
    except BaseException as e:  # noqa: BLE001
        error = _describe(e, tb=echo)
    finally:
        sys.stdin, sys.stdout, sys.stderr = saved
    return {"stdout": out.getvalue(), "error": error}


def _kind_of(e: BaseException) -> str:
    """memory, output (past the output or file-size limit: Python ignores SIGXFSZ, so a write fails with EFBIG),
    or error."""
    if isinstance(e, MemoryError):
        return "memory"
    if isinstance(e, OutputLimit) or (isinstance(e, OSError) and e.errno == errno.EFBIG):
        return "output"
    return "error"


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.strip().splitlines()]
    return [line for line in lines if line]


def _describe(e: BaseException, tb: bool = False) -> str:
    if tb:
        text = "".join(traceback.format_exception(e)[-6:])
    else:
        text = f"{type(e).__name__}: {e}"
    return text if len(text) <= MAX_ERROR else text[: MAX_ERROR - 3] + "..."
