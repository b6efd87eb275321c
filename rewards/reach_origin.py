"""Where code comes from, for a reward's reach: the user's code, an installed distribution, or the standard
library; how reached objects are labelled; and content hashes of data files.

"The user's code" is any module whose file is not under the standard library or an installed-packages
folder (so rlops' own built-ins count as user code). Labels are "module.qualname", with a reward file
loaded by path labelled by its file name, so a version does not depend on where the file lives.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import site
import sys
import sysconfig
from pathlib import Path
from typing import Any

from storage.settings import expand_cache

USER_FILE_MODULE_PREFIX = "rlops_user_reward_"  # module names given to reward files loaded by path


def content_hash(path: Path) -> str:
    """sha256 of a file's bytes, or of a folder's relative file names and contents."""
    digest = hashlib.sha256()
    for item in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if item.is_file():
            digest.update(str(item.relative_to(path)).encode() if path.is_dir() else b"")
            with open(item, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()


def local_path(value: str) -> Path | None:
    """`value` as an existing local file or folder (a leading `$RLOPS_CACHE` expanded), or None: a served model's
    name or a hub id is not a path."""
    value = expand_cache(value)
    path = Path(value).expanduser()
    return path if value and path.exists() else None


def path_content_hash(path: Path) -> str:
    """`content_hash` of a file or folder, computed once per process for each state of its files (a judge's
    ~0.5-1 GB of weights takes seconds to hash; a version is asked for many times)."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    state = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _hash_state(path.resolve(), state)


@functools.lru_cache(maxsize=64)
def _hash_state(path: Path, state: tuple[tuple[str, int, int], ...]) -> str:
    return content_hash(path)


@functools.cache
def _library_roots() -> tuple[Path, ...]:
    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths.update(site.getsitepackages() + [site.getusersitepackages()])
    return tuple(Path(p).resolve() for p in paths if p)


@functools.cache
def distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def is_stdlib(top: str) -> bool:
    return top in sys.stdlib_module_names or top in sys.builtin_module_names


def is_installed_file(file: str | None) -> bool:
    """True for the standard library's and installed packages' files (and modules without a file)."""
    if not file:
        return True  # built-in and frozen modules have no file
    if os.path.isabs(file):
        return _installed_absolute(file)
    return _installed(Path(file).resolve())  # relative to the working directory, which may change: not cached


@functools.lru_cache(maxsize=65536)
def _installed_absolute(file: str) -> bool:
    # Asked for every module in sys.modules each time a reward file is loaded or versioned (thousands of
    # paths, each resolved through the file system): measured 7 of a score stage test's 11 s uncached.
    return _installed(Path(file).resolve())


def _installed(path: Path) -> bool:
    return any(path.is_relative_to(root) for root in _library_roots())


def module_label(name: str) -> str:
    # A reward file loaded by path gets a module name made from its absolute path; label it by its file
    # name instead, so the version does not depend on where the file (or the workspace) lives.
    module = sys.modules.get(name)
    if name.startswith(USER_FILE_MODULE_PREFIX) and getattr(module, "__file__", None):
        return Path(module.__file__).name  # type: ignore[union-attr, arg-type]
    return name


def label_of(obj: Any) -> str:
    return f"{module_label(getattr(obj, '__module__', None) or '?')}.{getattr(obj, '__qualname__', getattr(obj, '__name__', '?'))}"
