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

This module holds the walk (`reach`, the walker, the description of values); the names a source loads
are found by rewards/reach_names.py, and where code comes from (user, library, standard library) and
how it is labelled is rewards/reach_origin.py.
"""

from __future__ import annotations

import ast
import enum
import functools
import hashlib
import importlib.metadata
import inspect
import marshal
import pickle
import re
import sys
import textwrap
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

from rewards.reach_names import Names, lookup, module_of
from rewards.reach_origin import content_hash, distributions, is_installed_file, is_stdlib, label_of, module_label


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
            walker.out.values[f"{label_of(fn)}.uses[{i}]"] = used
        else:
            walker.visit(used, f"{label_of(fn)}.uses[{i}]")
    for declared in files:
        path = Path(declared)
        if not path.is_absolute():
            path = Path(inspect.getfile(fn)).resolve().parent / path
        if not path.exists():
            raise ValueError(f"reward {fn.__name__} declares the data file {path}, which does not exist")
        walker.out.files[path.name] = content_hash(path)
    return walker.out


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
            self.visit(type(obj), label_of(type(obj)))
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
        if is_stdlib(top):
            self.out.libraries["python"] = f"{sys.version_info.major}.{sys.version_info.minor}"
            return
        dists = distributions().get(top)
        if dists:
            for dist in sorted(set(dists)):
                self.out.libraries[dist] = importlib.metadata.version(dist)
            return
        # Installed without metadata: its files are the only identity it has.
        module = sys.modules.get(top)
        file = getattr(module, "__file__", None)
        self.out.libraries[top] = content_hash(Path(file)) if file else "unknown"

    def is_user(self, module_name: str | None) -> bool:
        if not module_name:
            return False
        top = module_name.partition(".")[0]
        if is_stdlib(top) or module_name == "builtins":
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
        if not self.is_user(module.__name__):
            self.library(module.__name__)
            return
        if not self._first_visit(module):
            return
        label = module_label(module.__name__)
        try:
            self.out.code[f"{label} (whole module)"] = inspect.getsource(module)
        except (OSError, TypeError):
            self.out.code[f"{label} (whole module)"] = content_hash(Path(module.__file__)) if module.__file__ else label
        for name, value in list(vars(module).items()):
            if not (name.startswith("__") and name.endswith("__")):
                self.visit(value, f"{label}.{name}")

    def function(self, fn: types.FunctionType, top: bool = False) -> None:
        """A function: its source, its defaults and closure values, and what the names in its source reach."""
        if not self._first_visit(fn):
            return
        if not top and not self.is_user(fn.__module__):
            self.library(fn.__module__ or "builtins")
            return
        label = label_of(fn)
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
        Names(self, fn, cells, label, skip_decorators=True).visit(node)

    def cls(self, cls: type) -> None:
        """A class: its source, what its body and methods reach, and its base classes."""
        if not self._first_visit(cls):
            return
        if not self.is_user(cls.__module__):
            self.library(cls.__module__)
            return
        label = label_of(cls)
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
            Names(self, types.SimpleNamespace(__globals__=fake_globals), {}, label, skip_decorators=False,
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
                self.visit(base, label_of(base))

    def _name(self, fn: Any, name: str, cells: dict[str, Any], label: str) -> None:
        found, value = lookup(fn, name, cells)
        if found:
            self.visit(value, f"{module_label(module_of(fn))}.{name}")

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
            return f"path:{obj}" + (f":sha256={content_hash(path)}" if path.is_file() else "")
        if isinstance(obj, enum.Enum):
            self.visit(type(obj), label_of(type(obj)))
            return f"{label_of(type(obj))}.{obj.name}"
        if isinstance(obj, functools.partial):
            return f"partial({self.describe(obj.func, label, stack)}, {self.describe(obj.args, label, stack)}, " \
                   f"{self.describe(obj.keywords, label, stack)})"
        if isinstance(obj, types.ModuleType) or inspect.isroutine(obj) or inspect.isclass(obj):
            self.visit(obj, label)
            return f"<{label_of(obj) if not isinstance(obj, types.ModuleType) else obj.__name__}>"
        kind = type(obj)
        self.visit(kind, label_of(kind))
        if self.is_user(kind.__module__) and hasattr(obj, "__dict__"):
            return f"{label_of(kind)}({self.describe(vars(obj), label, stack)})"
        try:
            state = hashlib.sha256(pickle.dumps(obj, protocol=4)).hexdigest()
        except Exception:  # noqa: BLE001 - locks, clients, handles: runtime state, not data
            return f"<{label_of(kind)} instance>"
        return f"{label_of(kind)}:pickle-sha256={state}"

    def warn(self, message: str) -> None:
        if message not in self.out.warnings:
            self.out.warnings.append(message)

    def dynamic(self, fn: Any, label: str, reason: str, line: int) -> None:
        """`fn` does something whose reach is unknowable: version its whole module instead."""
        module_name = module_of(fn)
        self.warn(f"the version of reward {self.top.__name__}: {label} {reason} (line {line}), so what it runs "
                  f"cannot be determined; the whole module {module_label(module_name)} and everything it "
                  "references are versioned instead")
        module = sys.modules.get(module_name)
        if module is not None:
            self.module(module)


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
