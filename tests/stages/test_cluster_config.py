"""The `ray:` section: what reaches Ray's runtime_env."""

from __future__ import annotations

import stages
from stages.cluster import PACKAGES, RayConfig, runtime_env


def test_code_is_shipped_only_to_a_cluster():
    assert runtime_env(RayConfig()) == {}  # a local Ray's workers import this machine's code already
    env = runtime_env(RayConfig(address="10.0.0.5:6379", runtime_env={"env_vars": {"A": "1"}}))
    assert env["env_vars"] == {"A": "1"}
    assert [m.__name__ for m in env["py_modules"]] == list(PACKAGES) and stages in env["py_modules"]
    assert "py_modules" not in runtime_env(RayConfig(address="10.0.0.5:6379", ship_code=False))
