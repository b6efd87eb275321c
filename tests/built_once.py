"""A folder built once per test run and shared by every xdist worker (each worker has its own session, so a
session-scoped fixture alone builds it once per worker). The first worker to ask builds it under a lock, into a
temporary folder renamed into place when whole; the others wait, then read it. Only for deterministic builds
that tests read and never change (e.g. a model trained from a seeded tiny model).

    path = built_once(tmp_path_factory, "scripted", lambda out: train_scripted(tiny_model_dir, out))
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import Callable

import pytest


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """`build(folder)` run once per test run (not once per xdist worker); returns the finished folder."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's base temp folder, above every worker's own
    target = root / f"built-once-{name}"
    with open(root / f"built-once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if the build fails
        if not target.exists():
            partial = root / f"built-once-{name}.partial"
            shutil.rmtree(partial, ignore_errors=True)  # a build that failed in another worker
            partial.mkdir()
            build(partial)
            partial.rename(target)
    return target
