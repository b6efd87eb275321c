"""Write pytest's rewritten test modules to their `__pycache__` before the suite runs (`make bytecode`).

pytest rewrites the asserts of every test module and conftest.py it imports, and caches the result as a
`*-pytest-<version>.pyc` beside the module, unless PYTHONDONTWRITEBYTECODE is set: then every pytest process
(each xdist worker) parses and rewrites all of them again, ~4 s of CPU apiece on this machine kind (docs/BENCHMARKS.md,
"Where the suite's CPU goes"). The cache is hash-based (PEP 552: checked against the source's hash, not its mtime),
so what is written here is what pytest would write itself, and a module edited afterwards is rewritten as before.

    .venv/bin/python -m tests.assert_cache [ROOT]   # default: this checkout's tests/
"""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path

PATTERNS = ("test_*.py", "*_test.py", "conftest.py")  # pytest's default python_files, and conftests


def rewritten(root: Path) -> list[Path]:
    """Write the rewritten pyc of every test module and conftest.py under `root` whose cache is missing or stale;
    the modules written."""
    from _pytest.assertion.rewrite import PYC_TAIL, _read_pyc, _rewrite_test, _write_pyc_fp, get_cache_dir

    written = []
    for fn in sorted(root.rglob("*.py")):
        if "__pycache__" in fn.parts or not any(fnmatch.fnmatch(fn.name, p) for p in PATTERNS):
            continue
        pyc = get_cache_dir(fn) / (fn.name[:-3] + PYC_TAIL)
        if _read_pyc(fn, pyc, lambda *_: None) is not None:
            continue
        source_hash, co = _rewrite_test(fn, None)  # no config: enable_assertion_pass_hook off (pytest's default, ours)
        pyc.parent.mkdir(exist_ok=True)
        tmp = pyc.with_name(f"{pyc.name}.tmp")  # complete or absent, as pytest writes it
        with tmp.open("wb") as f:
            _write_pyc_fp(f, source_hash, co)  # pytest's own writer: its header and format
        tmp.replace(pyc)
        written.append(fn)
    return written


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent
    print(f"assert_cache: {len(rewritten(root))} test modules rewritten for pytest under {root}")
