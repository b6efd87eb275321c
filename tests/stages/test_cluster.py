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


# Run in a network namespace made to look like a real machine: an interface address (a veth pair,
# both ends in the namespace, so nothing leaves it) that Ray finds by a UDP connect to 8.8.8.8. That
# connect sends nothing but needs a route, so 8.8.8.8 has a host route via eth0; every other address
# outside the namespace's own is unreachable (no default route, no on-link subnet, no IPv6 on eth0),
# so a probe fails at once instead of sending a packet. Starts a two-node cluster at the given node
# address and a driver with one task, while polling every socket of the namespace; prints the remote
# addresses seen and the packets eth0 sent (from /proc/net/dev: /sys shows the outer namespace).
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
eth0 = next(line.split(":", 1)[1].split() for line in open("/proc/net/dev") if line.strip().startswith("eth0:"))
print(json.dumps({"seen": sorted(seen), "eth0_tx_packets": int(eth0[9])}))
"""
INTERFACE = "10.211.0.2"


def _addresses_used(node_ip: str) -> set[str]:
    """Remote addresses Ray's sockets named with nodes at `node_ip`; asserts eth0 sent no packet."""
    setup = ("ip link set lo up && sysctl -qw net.ipv6.conf.default.disable_ipv6=1 "
             f"&& ip link add eth0 type veth peer name eth1 && ip addr add {INTERFACE}/32 dev eth0 "
             "&& ip link set eth0 up && ip link set eth1 up && ip route add unreachable default "
             "&& ip route add 8.8.8.8/32 dev eth0")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run(["unshare", "-n", "sh", "-c", f'{setup} && exec "$0" -c "$1" {node_ip}', sys.executable,
                          ADDRESSES], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["eth0_tx_packets"] == 0  # nothing was sent to 8.8.8.8, the one address with a route
    return set(report["seen"])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("ip") is None or os.geteuid() != 0, reason="needs iproute2 and root (to make a namespace)")
def test_ray_traffic_stays_on_loopback_on_a_machine_with_an_interface_address():
    # Control: nodes at 127.0.0.1 are rewritten by Ray to the interface address, which then carries traffic.
    assert INTERFACE in _addresses_used("127.0.0.1")
    used = _addresses_used("127.0.0.2")  # what rlops and its tests use
    assert INTERFACE not in used
    # Ray's dashboard still tries cloud metadata (and a host lookup) whatever it is told; here those
    # fail on the unreachable route without a packet, as they do in .ci/loopback's namespace. The
    # only address beyond loopback a socket names is 8.8.8.8, by the UDP connect that sends nothing.
    import ipaddress

    beyond = {a for a in used if not (ipaddress.ip_address(a).is_loopback or ipaddress.ip_address(a).is_unspecified)}
    assert beyond <= {"8.8.8.8"}, beyond
