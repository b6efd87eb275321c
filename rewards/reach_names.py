"""The names a function's source loads, for a reward's reach: an `ast` visitor that resolves each name, and
each `a.b.c` chain, to the object the function would see, and hands it to the walker.

Calls that make what a function runs unknowable from its source (`eval`, `importlib.import_module`,
`getattr` on a module with a computed name, ...) are reported to the walker, which then versions the
whole module. Imports inside a function bind names too: a library is recorded by its distribution
(never imported here), a module of the user's code is imported and walked.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import sys
import types
from typing import Any, Protocol

from rewards.reach_origin import is_installed_file, is_stdlib, module_label

# Built-ins whose call makes the code a function runs unknowable from its source.
_DYNAMIC_CALLS = {
    builtins.eval: "calls eval()",
    builtins.exec: "calls exec()",
    builtins.compile: "calls compile()",
    builtins.__import__: "calls __import__()",
    builtins.globals: "calls globals()",
    builtins.locals: "calls locals()",
    builtins.vars: "calls vars()",
    importlib.import_module: "imports a module by a computed name (importlib.import_module)",
    importlib.__import__: "calls importlib.__import__()",
    importlib.util.module_from_spec: "builds a module at run time (importlib.util.module_from_spec)",
}


class Walker(Protocol):
    """What `Names` reports what it finds to: the reach walker (rewards/reach.py)."""

    out: Any  # the `Reach` being built: `Names` records an unimportable import among its values

    def visit(self, obj: Any, label: str) -> None: ...

    def library(self, module_name: str) -> None: ...

    def is_user(self, module_name: str | None) -> bool: ...

    def dynamic(self, fn: Any, label: str, reason: str, line: int) -> None: ...


def module_of(fn: Any) -> str:
    return fn.__globals__.get("__name__", "?") if isinstance(getattr(fn, "__globals__", None), dict) else "?"


def lookup(fn: Any, name: str, cells: dict[str, Any]) -> tuple[bool, Any]:
    """Resolve a name as the function sees it: closure, then module globals, then built-ins."""
    if name in cells:
        return True, cells[name]
    if name in fn.__globals__:
        return True, fn.__globals__[name]
    if hasattr(builtins, name):
        return True, getattr(builtins, name)
    return False, None


class Names(ast.NodeVisitor):
    """Follows every name a function's (or class body's) source loads, resolving `a.b.c` chains."""

    def __init__(self, walker: Walker, fn: Any, cells: dict[str, Any], label: str, skip_decorators: bool,
                 skip_functions: bool = False) -> None:
        self.walker, self.fn, self.cells, self.label = walker, fn, cells, label
        self.skip_decorators, self.skip_functions = skip_decorators, skip_functions
        self.local_imports: dict[str, Any] = {}  # names bound by imports inside the function
        code = getattr(fn, "__code__", None)
        self.line_offset = code.co_firstlineno - 1 if code else 0  # AST lines count from the source's start
        self.depth = 0

    def resolve(self, node: ast.expr) -> tuple[bool, Any, str]:
        """The object an expression of names and attributes stands for: (found, object, label)."""
        if isinstance(node, ast.Name):
            if node.id in self.local_imports:
                return True, self.local_imports[node.id], node.id
            found, value = lookup(self.fn, node.id, self.cells)
            return found, value, f"{module_label(module_of(self.fn))}.{node.id}"
        if isinstance(node, ast.Attribute):
            found, value, label = self.resolve(node.value)
            # Only modules are looked into: `mod.helper` is the helper, but `obj.attr` on a class or value
            # is already covered by that class's or value's own entry.
            if found and isinstance(value, types.ModuleType) and hasattr(value, node.attr):
                return True, getattr(value, node.attr), f"{value.__name__}.{node.attr}"
            return found, value, label
        return False, None, ""

    # -- definitions: skip what cannot change behaviour (annotations) and, for the reward, its decorator

    def _function_def(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        if self.skip_functions and self.depth > 0 and not isinstance(node, ast.Lambda):
            return  # methods are walked as functions of their own
        if not isinstance(node, ast.Lambda) and not (self.skip_decorators and self.depth == 0):
            for d in node.decorator_list:
                self.visit(d)
        args = node.args
        for default in args.defaults + [d for d in args.kw_defaults if d is not None]:
            self.visit(default)
        self.depth += 1
        for stmt in node.body if isinstance(node.body, list) else [node.body]:
            self.visit(stmt)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function_def

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for expr in node.decorator_list + node.bases + [k.value for k in node.keywords]:
            self.visit(expr)
        self.depth += 1
        for stmt in node.body:
            self.visit(stmt)
        self.depth -= 1

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)

    # -- loads

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self._reach(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, ast.Load) and _is_chain(node):
            self._reach(node)
        else:
            self.generic_visit(node)

    def _reach(self, node: ast.expr) -> None:
        found, value, label = self.resolve(node)
        if not found:
            return
        owner = _owner_module(self, node)
        if owner is not None and not self.walker.is_user(owner.__name__):
            # Whatever an installed module holds (os.environ, re.MULTILINE, numpy.pi) is that library's,
            # and it enters with the library's version: its values are runtime state, not the user's data.
            self.walker.library(owner.__name__)
            return
        if value is sys.modules:
            self.walker.dynamic(self.fn, self.label, "reads sys.modules", node.lineno + self.line_offset)
        # `mod.name` where mod has no such attribute (yet) resolved to mod itself: all of mod is versioned.
        self.walker.visit(value, label)

    def visit_Call(self, node: ast.Call) -> None:
        found, value, _ = self.resolve(node.func) if _is_chain(node.func) else (False, None, "")
        if found:
            reason = _DYNAMIC_CALLS.get(value) if _hashable(value) else None
            if reason is None and any(value is f for f in (getattr, hasattr, setattr, delattr)) and len(node.args) >= 2:
                target_found, target, _ = self.resolve(node.args[0]) if _is_chain(node.args[0]) else (False, None, "")
                if target_found and isinstance(target, types.ModuleType) and not isinstance(node.args[1], ast.Constant):
                    reason = f"calls {value.__name__}() on the module {target.__name__} with a computed name"
            if reason:
                self.walker.dynamic(self.fn, self.label, reason, node.lineno + self.line_offset)
        self.generic_visit(node)

    # -- imports inside functions: a library by distribution, a user module walked (never imported if a library)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            module = self._import(alias.name)
            if module is not None:
                bound = alias.asname or alias.name.partition(".")[0]
                self.local_imports[bound] = module if alias.asname else sys.modules[alias.name.partition(".")[0]]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        name = node.module or ""
        if node.level:
            try:
                name = importlib.util.resolve_name("." * node.level + name, module_of(self.fn).rpartition(".")[0])
            except (ImportError, ValueError):  # a relative import outside a package fails when it runs, too
                return
        module = self._import(name)
        if module is None:
            return
        for alias in node.names:
            if alias.name == "*":
                self.walker.visit(module, name)
            elif hasattr(module, alias.name):
                self.local_imports[alias.asname or alias.name] = getattr(module, alias.name)
            else:  # a submodule
                submodule = self._import(f"{name}.{alias.name}")
                if submodule is not None:
                    self.local_imports[alias.asname or alias.name] = submodule

    def _import(self, name: str) -> types.ModuleType | None:
        """The user module `name` (imported), or None after recording an installed one's distribution."""
        top = name.partition(".")[0]
        if is_stdlib(top):
            self.walker.library(top)
            return None
        try:
            spec = importlib.util.find_spec(top)
            if spec is None or is_installed_file(spec.origin or (list(spec.submodule_search_locations or [None])[0])):
                self.walker.library(top)  # installed code: never imported here (torch would cost seconds)
                return None
            return importlib.import_module(name)
        except ImportError as e:  # e.g. an optional import guarded by try/except: whether it imports is versioned
            self.walker.out.values[f"import {name}"] = f"not importable: {type(e).__name__}"
            return None


def _owner_module(names: Names, node: ast.expr) -> types.ModuleType | None:
    """The module the value of a chain was taken from: `os` for `os.environ.get`, `pkg.mod` for
    `pkg.mod.fn`; None for a bare name (a global of the function's own module)."""
    while isinstance(node, ast.Attribute):
        found, base, _ = names.resolve(node.value)
        if found and isinstance(base, types.ModuleType) and hasattr(base, node.attr):
            return base
        node = node.value
    return None


def _is_chain(node: ast.expr) -> bool:
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True
