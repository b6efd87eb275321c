"""`stages.cluster.connect` on a real local Ray: never an accidental join, and loopback addresses."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

CONNECT = """
import ray
from stages.cluster import RayConfig, connect
connect(RayConfig(), num_cpus=1)
print("GCS", ray.get_runtime_context().gcs_address)
print("NODES", sorted({n["NodeManagerAddress"] for n in ray.nodes()}))
ray.shutdown()
"""
PLAIN = "import ray; ray.init(num_cpus=1, include_dashboard=False)"  # what `connect` did before


@pytest.mark.slow
def test_without_an_address_rlops_starts_its_own_ray_whatever_the_machine_says():
    # A stale `ray_current_cluster` file (left by any `ray start`) and a RAY_ADDRESS naming a dead
    # cluster: a plain ray.init(num_cpus=...) tries to join and fails; connect starts its own.
    temp = Path(tempfile.mkdtemp(prefix="rlt-", dir="/tmp"))  # short: Ray puts unix sockets under it
    try:
        (temp / "ray").mkdir()
        (temp / "ray" / "ray_current_cluster").write_text("127.0.0.9:6379")
        for extra in ({}, {"RAY_ADDRESS": "127.0.0.9:6379"}):
            env = {**os.environ, "RAY_TMPDIR": str(temp), "RAY_USAGE_STATS_ENABLED": "0", **extra}
            before = subprocess.run([sys.executable, "-c", PLAIN], env=env, capture_output=True, text=True, timeout=120)
            assert before.returncode != 0  # the defect this guards against is real in this environment
            out = subprocess.run([sys.executable, "-c", CONNECT], env=env, capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr[-3000:]
            lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("GCS", "NODES")))
            # Its own node, on the loopback address Ray keeps as given (127.0.0.1 it would rewrite).
            assert lines["GCS"].startswith("127.0.0.2:") and lines["NODES"] == "['127.0.0.2']"
    finally:
        shutil.rmtree(temp, ignore_errors=True)


# Run in a network namespace made to look like a real machine: an interface address and a default
# route (a veth pair, both ends in the namespace, so nothing leaves it). Starts a two-node cluster at
# the given node address and a driver with one task, while polling every socket of the namespace.
ADDRESSES = """
import ipaddress, json, subprocess, sys, threading, time
import tests.ray_cluster as rc

rc.NODE_IP = sys.argv[1]
seen, stop = set(), threading.Event()


def decode(hexaddr):
    raw = bytes.fromhex(hexaddr.split(":")[0])
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    ip = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return str(ip.ipv4_mapped or ip)


def poll():
    while not stop.is_set():
        for name in ("tcp", "tcp6", "udp", "udp6"):
            seen.update(decode(line.split()[2]) for line in open(f"/proc/net/{name}").read().splitlines()[1:])
        time.sleep(0.1)


threading.Thread(target=poll, daemon=True).start()
with rc.LocalRayCluster(worker_cpus=1) as cluster:
    driver = ("import ray; from stages.cluster import RayConfig, connect; "
              "connect(RayConfig(address=%r, ship_code=False), 1); print(ray.get(ray.remote(lambda: 41).remote()) + 1)"
              % cluster.address)
    out = subprocess.run([sys.executable, "-c", driver], env=cluster.env, capture_output=True, text=True, timeout=300)
    assert out.stdout.split()[-1:] == ["42"], out.stderr[-3000:]
stop.set()
print(json.dumps(sorted(seen)))
"""
INTERFACE = "10.211.0.2"


def _addresses_used(node_ip: str) -> set[str]:
    setup = (f"ip link set lo up && ip link add eth0 type veth peer name eth1 && ip addr add {INTERFACE}/24 dev eth0 "
             f"&& ip link set eth0 up && ip link set eth1 up && ip route add default dev eth0")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run(["unshare", "-n", "sh", "-c", f'{setup} && exec "$0" -c "$1" {node_ip}', sys.executable,
                          ADDRESSES], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("ip") is None or os.geteuid() != 0, reason="needs iproute2 and root (to make a namespace)")
def test_ray_traffic_stays_on_loopback_on_a_machine_with_an_interface_address():
    # Control: nodes at 127.0.0.1 are rewritten by Ray to the interface address, which then carries traffic.
    assert INTERFACE in _addresses_used("127.0.0.1")
    used = _addresses_used("127.0.0.2")  # what rlops and its tests use
    assert INTERFACE not in used
    # Left: Ray's dashboard probes cloud metadata (and looks a host up) whatever it is told; only a
    # network namespace (.ci/loopback) stops that.
    import ipaddress

    beyond = {a for a in used if not (ipaddress.ip_address(a).is_loopback or ipaddress.ip_address(a).is_unspecified)}
    nameservers = {line.split()[1] for line in Path("/etc/resolv.conf").read_text().splitlines()
                   if line.startswith("nameserver")} if Path("/etc/resolv.conf").exists() else set()
    assert beyond <= {"169.254.169.254"} | nameservers, beyond
