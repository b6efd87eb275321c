"""What a reward's version covers: everything of the user's code it can reach, and what else it reads.

    r = reach(numeric_match)
    r.code       # {"rewards.builtin.numeric_match": "<source>", "rewards.builtin.final_answer": ..., ...}
    r.values     # {"rewards.builtin.NUMBER_RE": "re.Pattern:'...':32", ...}  module constants, closures, defaults
    r.libraries  # {"python": "3.11", "httpx": "0.28.1"}  installed code enters by distribution and version
    r.files      # {"lexicon.txt": "<sha256>"}  data files: declared with @reward(files=...), or Path constants
    r.warnings   # why a part of the reach could not be determined (then versioned conservatively)

The walk starts at the reward function and follows, transitively, every name its source loads
(its body, nested functions, default expressions): a helper function or class of the user's code
adds its source and is walked in turn; `module.attr` chains are resolved to the attribute, so
`helpers.normalize(x)` reaches `normalize`, not all of `helpers`; a module-level value adds a
description of its content; a closure cell adds its value. "The user's code" is any module whose
file is not under the standard library or an installed-packages folder (so rlops' own built-ins
count as user code and follow the same rule). Code of installed packages is not read: it enters
as `distribution == version` (the standard library as the Python major.minor version), so an
upgrade changes the version and the package's files are never hashed.

Where the reach cannot be known from the source (`eval`, `exec`, `compile`, `__import__`,
`importlib.import_module`, `globals()`/`vars()`/`locals()`, `getattr` on a module with a computed
name, `sys.modules`), the whole module holding that code is versioned, with everything it
references, and a `ReachWarning` says why. Code reached only through a parameter's attributes
(methods of the objects a reward is called with) cannot be seen from names: the rollout's class
is rlops' own schema; anything else a reward relies on that way belongs in `uses=`.
"""

from __future__ import annotations

import ast
import builtins
import enum
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import marshal
import pickle
import re
import site
import sys
import sysconfig
import textwrap
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

USER_FILE_MODULE_PREFIX = "rlops_user_reward_"  # module names given to reward files loaded by path

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


class ReachWarning(UserWarning):
    """Part of a reward's reach could not be determined; that part is versioned conservatively."""


@dataclass
class Reach:
    """What a reward can reach, as text: the input of its version hash (see the module docstring)."""

    code: dict[str, str] = field(default_factory=dict)  # "module.qualname" -> source
    values: dict[str, str] = field(default_factory=dict)  # "module.NAME" -> description of the value
    libraries: dict[str, str] = field(default_factory=dict)  # distribution -> version
    files: dict[str, str] = field(default_factory=dict)  # data file name -> sha256 of its content
    warnings: list[str] = field(default_factory=list)

    def fingerprint(self) -> dict[str, Any]:
        """The JSON-able part that enters the version (warnings do not)."""
        return {"code": self.code, "values": self.values, "libraries": self.libraries, "files": self.files}


def reach(fn: Callable[..., Any], uses: Iterable[Any] = (), files: Iterable[str | PurePath] = ()) -> Reach:
    """Walk everything `fn` can reach, plus the declared `uses` (objects) and `files` (data files).

    Relative `files` are resolved against the folder of `fn`'s module file. A declared file that does
    not exist raises ValueError (a config error: the version would not cover it).
    """
    walker = _Walker(fn)
    walker.function(fn, top=True)
    for i, used in enumerate(uses):
        if isinstance(used, str):
            walker.out.values[f"{_label(fn)}.uses[{i}]"] = used
        else:
            walker.visit(used, f"{_label(fn)}.uses[{i}]")
    for declared in files:
        path = Path(declared)
        if not path.is_absolute():
            path = Path(inspect.getfile(fn)).resolve().parent / path
        if not path.exists():
            raise ValueError(f"reward {fn.__name__} declares the data file {path}, which does not exist")
        walker.out.files[path.name] = _content_hash(path)
    return walker.out


def _content_hash(path: Path) -> str:
    """sha256 of a file's bytes, or of a folder's relative file names and contents."""
    digest = hashlib.sha256()
    for item in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if item.is_file():
            digest.update(str(item.relative_to(path)).encode() if path.is_dir() else b"")
            with open(item, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()


# --- where code comes from --------------------------------------------------------------------------


@functools.cache
def _library_roots() -> tuple[Path, ...]:
    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths.update(site.getsitepackages() + [site.getusersitepackages()])
    return tuple(Path(p).resolve() for p in paths if p)


@functools.cache
def _distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _is_stdlib(top: str) -> bool:
    return top in sys.stdlib_module_names or top in sys.builtin_module_names


def is_installed_file(file: str | None) -> bool:
    """True for the standard library's and installed packages' files (and modules without a file)."""
    if not file:
        return True  # built-in and frozen modules have no file
    path = Path(file).resolve()
    return any(path.is_relative_to(root) for root in _library_roots())


def _module_label(name: str) -> str:
    # A reward file loaded by path gets a module name made from its absolute path; label it by its file
    # name instead, so the version does not depend on where the file (or the workspace) lives.
    module = sys.modules.get(name)
    if name.startswith(USER_FILE_MODULE_PREFIX) and getattr(module, "__file__", None):
        return Path(module.__file__).name  # type: ignore[union-attr, arg-type]
    return name


def _label(obj: Any) -> str:
    return f"{_module_label(getattr(obj, '__module__', None) or '?')}.{getattr(obj, '__qualname__', getattr(obj, '__name__', '?'))}"


class _Walker:
    def __init__(self, top: Callable[..., Any]) -> None:
        self.top = top
        self.out = Reach()
        self.seen: set[int] = set()
        self.keep: list[Any] = []  # objects whose id is in `seen` stay alive, so ids are not reused

    # -- dispatch

    def visit(self, obj: Any, label: str) -> None:
        """Fold `obj`, found under `label`, into the reach."""
        if isinstance(obj, types.MethodType):
            self.visit(obj.__self__, f"{label}.__self__")
            obj = obj.__func__
        if isinstance(obj, types.ModuleType):
            self.module(obj)
        elif inspect.isfunction(obj):
            self.function(obj)
        elif inspect.isclass(obj):
            self.cls(obj)
        elif isinstance(obj, (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType)):
            self.library(getattr(obj, "__module__", None) or "builtins")
        elif callable(obj) and hasattr(obj, "__wrapped__"):  # functools.lru_cache and other wrapper objects
            self.visit(type(obj), _label(type(obj)))
            self.visit(obj.__wrapped__, label)
        else:
            self.out.values[label] = self.describe(obj, label)

    def _first_visit(self, obj: Any) -> bool:
        if id(obj) in self.seen:
            return False
        self.seen.add(id(obj))
        self.keep.append(obj)
        return True

    def library(self, module_name: str) -> None:
        """Record the distribution (and version) that `module_name` comes from."""
        top = module_name.partition(".")[0]
        if top == "builtins":
            return  # the language itself, covered by nothing finer than the Python version
        if _is_stdlib(top):
            self.out.libraries["python"] = f"{sys.version_info.major}.{sys.version_info.minor}"
            return
        dists = _distributions().get(top)
        if dists:
            for dist in sorted(set(dists)):
                self.out.libraries[dist] = importlib.metadata.version(dist)
            return
        # Installed without metadata: its files are the only identity it has.
        module = sys.modules.get(top)
        file = getattr(module, "__file__", None)
        self.out.libraries[top] = _content_hash(Path(file)) if file else "unknown"

    def _is_user(self, module_name: str | None) -> bool:
        if not module_name:
            return False
        top = module_name.partition(".")[0]
        if _is_stdlib(top) or module_name == "builtins":
            return False
        module = sys.modules.get(module_name)
        if module is None:
            return False
        file = getattr(module, "__file__", None)
        if file is None:
            # No file: a namespace package (installed if all its folders are), or code made at run time
            # (a notebook's __main__): that is the user's, and versioned as such.
            folders = list(getattr(module, "__path__", []))
            return not folders or not all(is_installed_file(f) for f in folders)
        return not is_installed_file(file)

    # -- code

    def module(self, module: types.ModuleType) -> None:
        """A module reached as a whole: its full source and everything its globals reach (user code),
        or its distribution (a library)."""
        if not self._is_user(module.__name__):
            self.library(module.__name__)
            return
        if not self._first_visit(module):
            return
        label = _module_label(module.__name__)
        try:
            self.out.code[f"{label} (whole module)"] = inspect.getsource(module)
        except (OSError, TypeError):
            self.out.code[f"{label} (whole module)"] = _content_hash(Path(module.__file__)) if module.__file__ else label
        for name, value in list(vars(module).items()):
            if not (name.startswith("__") and name.endswith("__")):
                self.visit(value, f"{label}.{name}")

    def function(self, fn: types.FunctionType, top: bool = False) -> None:
        """A function: its source, its defaults and closure values, and what the names in its source reach."""
        if not self._first_visit(fn):
            return
        if not top and not self._is_user(fn.__module__):
            self.library(fn.__module__ or "builtins")
            return
        label = _label(fn)
        if hasattr(fn, "__wrapped__"):  # a decorator's wrapper: the wrapped function is reached too
            self.visit(fn.__wrapped__, f"{label}.__wrapped__")
        if fn.__defaults__ or fn.__kwdefaults__:
            self.out.values[f"{label}.<defaults>"] = self.describe((fn.__defaults__, fn.__kwdefaults__), label)
        closure = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
        cells: dict[str, Any] = {}
        for name, cell in closure.items():
            try:
                cells[name] = cell.cell_contents
            except ValueError:  # an empty cell: the enclosing function has not assigned it yet
                continue
            self.visit(cells[name], f"{label}.<closure {name}>")
        try:
            # The code object's source, not the function's: getsource(fn) would follow `__wrapped__` and
            # show the wrapped function instead of a wrapper's own code. It includes the decorator lines.
            source = inspect.getsource(fn.__code__)
            tree = ast.parse(textwrap.dedent(source))
        except (OSError, TypeError, SyntaxError, IndentationError):
            source = None
        if source is None:
            # No parsable source (a lambda inside a longer expression, code built at run time): the bytecode
            # is the code's identity, and every global name any of its code objects loads is followed.
            self.out.code[label] = hashlib.sha256(marshal.dumps(fn.__code__)).hexdigest()
            for name in _code_names(fn.__code__):
                self._name(fn, name, cells, label)
            return
        self.out.code[label] = source
        node = tree.body[0] if tree.body else tree
        _Names(self, fn, cells, label, skip_decorators=True).visit(node)

    def cls(self, cls: type) -> None:
        """A class: its source, what its body and methods reach, and its base classes."""
        if not self._first_visit(cls):
            return
        if not self._is_user(cls.__module__):
            self.library(cls.__module__)
            return
        label = _label(cls)
        try:
            source = inspect.getsource(cls)
            tree = ast.parse(textwrap.dedent(source))
        except (OSError, TypeError, SyntaxError, IndentationError):
            self.warn(f"{label} has no readable source; it is versioned by its name and members only")
            self.out.code[label] = repr(sorted(vars(cls)))
        else:
            self.out.code[label] = source
            module = sys.modules.get(cls.__module__)
            fake_globals = vars(module) if module else {}
            _Names(self, types.SimpleNamespace(__globals__=fake_globals), {}, label, skip_decorators=False,
                   skip_functions=True).visit(tree.body[0])
        file = getattr(sys.modules.get(cls.__module__), "__file__", None)
        for name, member in vars(cls).items():
            for fn in _member_functions(member):
                # Generated methods (dataclass __init__, __eq__) come from exec'd code with no file:
                # the class source above already covers them.
                if file and fn.__code__.co_filename == file:
                    self.function(fn)
        for base in cls.__mro__[1:]:
            if base is not object:
                self.visit(base, _label(base))

    def _name(self, fn: Any, name: str, cells: dict[str, Any], label: str) -> None:
        found, value = _lookup(fn, name, cells)
        if found:
            self.visit(value, f"{_module_label(_module_of(fn))}.{name}")

    # -- values

    def describe(self, obj: Any, label: str, _stack: tuple[int, ...] = ()) -> str:
        """Text that changes when the value's content does; code found inside it is walked."""
        if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
            return f"{type(obj).__name__}:{obj!r}"
        if id(obj) in _stack:
            return "<cycle>"
        stack = _stack + (id(obj),)
        if isinstance(obj, (list, tuple, set, frozenset)):
            items = [self.describe(x, label, stack) for x in obj]
            return f"{type(obj).__name__}[{', '.join(sorted(items) if isinstance(obj, (set, frozenset)) else items)}]"
        if isinstance(obj, dict):
            items = sorted(f"{self.describe(k, label, stack)}: {self.describe(v, label, stack)}" for k, v in obj.items())
            return f"{type(obj).__name__}{{{', '.join(items)}}}"
        if isinstance(obj, re.Pattern):
            return f"re.Pattern:{obj.pattern!r}:{obj.flags}"
        if isinstance(obj, PurePath):
            path = Path(obj)
            # A module-level path to a data file stands for the file: its content is versioned.
            return f"path:{obj}" + (f":sha256={_content_hash(path)}" if path.is_file() else "")
        if isinstance(obj, enum.Enum):
            self.visit(type(obj), _label(type(obj)))
            return f"{_label(type(obj))}.{obj.name}"
        if isinstance(obj, functools.partial):
            return f"partial({self.describe(obj.func, label, stack)}, {self.describe(obj.args, label, stack)}, " \
                   f"{self.describe(obj.keywords, label, stack)})"
        if isinstance(obj, types.ModuleType) or inspect.isroutine(obj) or inspect.isclass(obj):
            self.visit(obj, label)
            return f"<{_label(obj) if not isinstance(obj, types.ModuleType) else obj.__name__}>"
        kind = type(obj)
        self.visit(kind, _label(kind))
        if self._is_user(kind.__module__) and hasattr(obj, "__dict__"):
            return f"{_label(kind)}({self.describe(vars(obj), label, stack)})"
        try:
            state = hashlib.sha256(pickle.dumps(obj, protocol=4)).hexdigest()
        except Exception:  # noqa: BLE001 - locks, clients, handles: runtime state, not data
            return f"<{_label(kind)} instance>"
        return f"{_label(kind)}:pickle-sha256={state}"

    def warn(self, message: str) -> None:
        if message not in self.out.warnings:
            self.out.warnings.append(message)

    def dynamic(self, fn: Any, label: str, reason: str, line: int) -> None:
        """`fn` does something whose reach is unknowable: version its whole module instead."""
        module_name = _module_of(fn)
        self.warn(f"the version of reward {self.top.__name__}: {label} {reason} (line {line}), so what it runs "
                  f"cannot be determined; the whole module {_module_label(module_name)} and everything it "
                  "references are versioned instead")
        module = sys.modules.get(module_name)
        if module is not None:
            self.module(module)


def _module_of(fn: Any) -> str:
    return fn.__globals__.get("__name__", "?") if isinstance(getattr(fn, "__globals__", None), dict) else "?"


def _lookup(fn: Any, name: str, cells: dict[str, Any]) -> tuple[bool, Any]:
    """Resolve a name as the function sees it: closure, then module globals, then built-ins."""
    if name in cells:
        return True, cells[name]
    if name in fn.__globals__:
        return True, fn.__globals__[name]
    if hasattr(builtins, name):
        return True, getattr(builtins, name)
    return False, None


def _member_functions(member: Any) -> list[types.FunctionType]:
    if isinstance(member, (staticmethod, classmethod)):
        member = member.__func__
    if isinstance(member, property):
        return [f for f in (member.fget, member.fset, member.fdel) if inspect.isfunction(f)]
    return [member] if inspect.isfunction(member) else []


def _code_names(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _code_names(const)
    return names


class _Names(ast.NodeVisitor):
    """Follows every name a function's (or class body's) source loads, resolving `a.b.c` chains."""

    def __init__(self, walker: _Walker, fn: Any, cells: dict[str, Any], label: str, skip_decorators: bool,
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
            found, value = _lookup(self.fn, node.id, self.cells)
            return found, value, f"{_module_label(_module_of(self.fn))}.{node.id}"
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
        if owner is not None and not self.walker._is_user(owner.__name__):
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
                name = importlib.util.resolve_name("." * node.level + name, _module_of(self.fn).rpartition(".")[0])
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
        if _is_stdlib(top):
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


def _owner_module(names: _Names, node: ast.expr) -> types.ModuleType | None:
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
