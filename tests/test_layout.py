"""The code's layout, checked from the source: no import cycles, imports only down the layers, short files.

Every module under flows/, stages/, rewards/, storage/ and tasks/ is parsed with `ast`; every import
counts, wherever it stands: at module level, inside a function, or under `if TYPE_CHECKING:` (a
type-only import still ties two modules together for a reader and for the next refactoring).

- No cycles between modules: an SCC of the import graph with more than one module fails, named.
- Layers (docs/ARCHITECTURE.md): flows -> stages -> (tasks, rewards) -> storage -> sandbox. tasks and rewards do
  not import each other. Inside stages/, the rooms (policy/, service/, update/) never import the five
  stage modules; policy/ imports neither service/ nor update/, and service/ and update/ not each other.
- No .py file of the repository over 400 lines (tests and bench included; STYLE.md: split by concern).
"""

from __future__ import annotations

import ast
import subprocess
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("flows", "stages", "rewards", "storage", "tasks", "sandbox")
# sandbox/ sits below everything: rewards (rewards.code) and tasks (the python tool) use it, it imports nothing of rlops
LAYER = {"sandbox": -1, "storage": 0, "tasks": 1, "rewards": 1, "stages": 2, "flows": 3}
STAGES = {f"stages.{name}" for name in ("sft", "rollout", "score", "grpo", "evaluate")}
ROOMS = ("stages.policy", "stages.service", "stages.update")
MAX_LINES = 400


def module_files() -> dict[str, Path]:
    """Module name -> file, for every module of the five packages (a package is its __init__)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(module: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """(module imported, line) for every import statement in the file that names one of `known`."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod.
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # `import a.b.c` of a module-less name: its nearest module
                name = name.rpartition(".")[0]
            if name and name != module:
                yield name, node.lineno


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported module: first line importing it}."""
    files = module_files()
    graph: dict[str, dict[str, int]] = {m: {} for m in files}
    for module, path in files.items():
        for target, line in imported(module, path, set(files)):
            graph[module].setdefault(target, line)
    return graph


def components(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): each holds import cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def cycles(graph: dict[str, dict[str, int]]) -> list[str]:
    """Each component's modules and a shortest cycle through its first one, as text."""
    return [f"{{{', '.join(c)}}}: e.g. {' -> '.join(_cycle_in(c, graph))}" for c in components(graph)]


def _cycle_in(component: list[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    return paths[v] + [start]
                if w in members and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return component


def _room(module: str) -> str | None:
    return next((r for r in ROOMS if module == r or module.startswith(r + ".")), None)


def upward(graph: dict[str, dict[str, int]]) -> list[str]:
    """Imports that point up (or across) the layers, as 'a -> b (line n)'."""
    out = []
    for a, targets in sorted(graph.items()):
        for b, line in sorted(targets.items()):
            top_a, top_b = a.partition(".")[0], b.partition(".")[0]
            wrong = top_a != top_b and LAYER[top_b] >= LAYER[top_a]
            room_a, room_b = _room(a), _room(b)
            if room_a is not None:
                wrong |= b in STAGES  # the rooms serve the stages, never the reverse
                wrong |= room_b is not None and room_b != room_a and room_b != "stages.policy"
            if wrong:
                out.append(f"{a} -> {b} (line {line})")
    return out


def python_files() -> list[Path]:
    """Every .py file of the repository that git does not ignore (tracked or not: a new file counts too)."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: everything outside hidden folders
        return [p for p in sorted(ROOT.rglob("*.py")) if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]
    return [ROOT / f for f in sorted(set(out)) if (ROOT / f).exists()]


def long_files() -> list[str]:
    out = []
    for path in python_files():
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            out.append(f"{path.relative_to(ROOT)}: {n} lines")
    return out


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(found)


def test_imports_point_down_the_layers() -> None:
    found = upward(import_graph())
    assert not found, "imports against the layers:\n" + "\n".join(found)


def test_no_file_over_400_lines() -> None:
    found = long_files()
    assert not found, f"files over {MAX_LINES} lines (split by concern):\n" + "\n".join(found)


def test_the_checker_sees_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from stages.b import X\n"
              "def f():\n    from stages import c\n    from . import d\n")
    path = tmp_path / "a.py"
    path.write_text(source)
    found = dict(imported("stages.a", path, {"stages.a", "stages.b", "stages.c", "stages.d", "stages"}))
    assert set(found) == {"stages.b", "stages.c", "stages.d"}
    assert cycles({"x": {"y": 1}, "y": {"z": 1}, "z": {"x": 1}, "w": {"x": 1}}) == ["{x, y, z}: e.g. x -> y -> z -> x"]


if __name__ == "__main__":  # print the whole report: python tests/test_layout.py
    graph = import_graph()
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports between them")
    for title, found in (("cycles", cycles(graph)), ("upward imports", upward(graph)),
                         (f"files over {MAX_LINES} lines", long_files())):
        print(f"{title}: {len(found)}")
        for line in found:
            print(f"  {line}")
