"""The `ray:` section: what reaches Ray's runtime_env, and where resident actors go."""

from __future__ import annotations

import pytest

import stages
from stages import cluster
from stages.cluster import PACKAGES, RayConfig, runtime_env


def test_code_is_shipped_only_to_a_cluster():
    # A local Ray's workers import this machine's code already; gloo is kept on loopback.
    assert runtime_env(RayConfig()) == {"env_vars": {"GLOO_SOCKET_IFNAME": "lo"}}
    env = runtime_env(RayConfig(address="10.0.0.5:6379", runtime_env={"env_vars": {"A": "1"}}))
    assert env["env_vars"] == {"A": "1"}  # a real cluster: gloo picks its interface as configured
    assert [m.__name__ for m in env["py_modules"]] == list(PACKAGES) and stages in env["py_modules"]
    assert env["excludes"] == ["__pycache__"]  # bytecode stays here: unpacked there without its sources' times
    mine = runtime_env(RayConfig(address="10.0.0.5:6379", runtime_env={"excludes": ["*.csv"]}))
    assert mine["excludes"] == ["*.csv", "__pycache__"]
    assert "py_modules" not in runtime_env(RayConfig(address="10.0.0.5:6379", ship_code=False))


def test_a_loopback_cluster_keeps_gloo_on_lo_unless_configured():
    assert runtime_env(RayConfig(address="127.0.0.2:6379"))["env_vars"]["GLOO_SOCKET_IFNAME"] == "lo"
    mine = RayConfig(address="127.0.0.2:6379", runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "eth1"}})
    assert runtime_env(mine)["env_vars"]["GLOO_SOCKET_IFNAME"] == "eth1"


@pytest.mark.parametrize("nodes, n, expected", [
    ([("a", 2.0)], 2, [("a", 1), ("a", 1)]),
    ([("a", 2.0)], 1, [("a", 2)]),
    ([("a", 4.0), ("b", 2.0)], 3, [("a", 2), ("b", 2), ("a", 2)]),  # in proportion to their CPUs
    ([("a", 1.0)], 3, [("a", 1)] * 3),  # more actors than CPUs: one thread each, still placed
])
def test_spread_places_actors_in_proportion_to_cpus(monkeypatch, nodes, n, expected):
    monkeypatch.setattr(cluster, "cpu_nodes", lambda: nodes)
    assert cluster.spread(n) == expected


def test_spread_refuses_a_cluster_without_cpus(monkeypatch):
    monkeypatch.setattr(cluster, "cpu_nodes", lambda: [])
    with pytest.raises(RuntimeError, match="no node with CPUs"):
        cluster.spread(2)
