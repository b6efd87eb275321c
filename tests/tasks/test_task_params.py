"""Task params are validated from `make_task`'s signature before the task runs, and a bad one is a config
error that names it: on the Python API, in config validation, and on the CLI (exit code 2)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import yaml

from tasks.base import TaskParamsError, load_task

USER_TASK = textwrap.dedent(
    '''\
    from __future__ import annotations

    from pathlib import Path

    from tasks.base import Task

    CALLS = []  # what make_task was called with: it must never see bad params


    def make_task(size: int, ratio: float = 0.5, tags: list[str] | None = None, data: Path | None = None,
                  name: str = "t") -> Task:
        CALLS.append({"size": size, "ratio": ratio, "tags": tags, "data": data, "name": name})
        return Task(name=name, system_prompt="", prompts=lambda split: [])
    '''
)


@pytest.fixture
def user_task(tmp_path, monkeypatch):
    """A user's task module, `usertasks.mytask` (a task outside rlops is named by its module path)."""
    (tmp_path / "usertasks").mkdir()
    (tmp_path / "usertasks" / "__init__.py").touch()
    (tmp_path / "usertasks" / "mytask.py").write_text(USER_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    import usertasks.mytask

    yield usertasks.mytask
    for name in ("usertasks", "usertasks.mytask"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("params", "problems"),
    [
        ({"size": "two"}, ["task.params.size: expected int, got 'two'"]),
        ({"size": True}, ["task.params.size: expected int, got True"]),  # YAML `yes` is not a number
        ({"size": 2.5}, ["task.params.size: expected int, got 2.5"]),
        ({"size": 1, "ratio": "half"}, ["task.params.ratio: expected float, got 'half'"]),
        ({"size": 1, "tags": "a,b"}, ["task.params.tags: expected list[str] | None, got 'a,b'"]),
        ({"size": 1, "name": 3}, ["task.params.name: expected str, got 3"]),
        ({"size": 1, "sise": 2}, ["task.params.sise: unknown parameter (make_task takes size, ratio, tags, data, name)"]),
        ({}, ["task.params.size: required (make_task has no default for it)"]),
        ({"size": "x", "extra": 1}, ["task.params.size: expected int, got 'x'",
                                     "task.params.extra: unknown parameter (make_task takes size, ratio, tags, data, name)"]),
    ],
)
def test_bad_params_are_named_and_the_task_never_runs(user_task, params, problems) -> None:
    with pytest.raises(TaskParamsError) as caught:
        load_task("usertasks.mytask", params)
    assert sorted(caught.value.problems) == sorted(problems)
    assert user_task.CALLS == []


def test_good_params_reach_the_task_validated(user_task, tmp_path) -> None:
    load_task("usertasks.mytask", {"size": 3, "ratio": 1, "tags": ["a"], "data": str(tmp_path)})
    assert user_task.CALLS == [{"size": 3, "ratio": 1.0, "tags": ["a"], "data": tmp_path, "name": "t"}]
    assert isinstance(user_task.CALLS[0]["ratio"], float)  # an int fits a float param, and becomes one


def test_builtin_task_params_are_checked() -> None:
    with pytest.raises(TaskParamsError, match=r"^task.params.digits: expected int, got 'two'$"):
        load_task("arithmetic", {"digits": "two"})
    with pytest.raises(TaskParamsError, match="task.params.k: expected int, got '3'"):
        load_task("doc_search", {"k": "3"})


def test_the_cli_reports_a_bad_param_as_a_config_error(tmp_path) -> None:
    cfg = {"name": "bad", "task": {"name": "arithmetic", "params": {"digits": "two", "colour": "red"}},
           "score": {"rewards": [{"fn": "rewards.builtin.numeric_match"}]}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(path), "--workspace", str(tmp_path / "ws")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "task.params.digits: expected int, got 'two'" in out.stderr
    assert "task.params.colour: unknown parameter" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "ws" / "catalog.duckdb").exists()  # refused before any compute
