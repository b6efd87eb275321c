"""The suite's network guard (tests/netguard.py): a non-loopback connect, datagram or lookup is refused
before anything is sent, and fails the test it happened in."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

from tests import netguard


@pytest.mark.parametrize("host, allowed", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("::ffff:127.0.0.1", True), ("localhost", True),
    ("", True), ("0.0.0.0", True),
    ("169.254.169.254", False), ("10.0.0.5", False), ("192.168.1.1", False), ("8.8.8.8", False),
    ("2001:db8::1", False), ("metadata.google.internal", False), ("example.com", False),
])
def test_loopback_hosts(host, allowed):
    assert netguard.loopback_host(host) is allowed


def test_a_non_loopback_connect_is_refused_before_anything_is_sent():
    if netguard.in_namespace():
        # Inside .ci/loopback's namespace a real connect could not leave either (no route): the error
        # below is the guard's own, raised before the kernel is asked.
        assert open("/proc/net/dev").read().count(":") == 1
    for family, address in ((socket.AF_INET, ("169.254.169.254", 80)), (socket.AF_INET6, ("2001:db8::1", 80, 0, 0))):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            with pytest.raises(netguard.NonLoopbackError, match="connect to"):
                s.connect(address)
            with pytest.raises(netguard.NonLoopbackError):
                s.connect_ex(address)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        with pytest.raises(netguard.NonLoopbackError, match="datagram to"):
            s.sendto(b"x", ("10.1.2.3", 53))
        with pytest.raises(netguard.NonLoopbackError):
            s.connect(("8.8.8.8", 80))  # how Ray finds "its" address: no packet, but it targets one
    with pytest.raises(netguard.NonLoopbackError, match="name lookup"):
        socket.getaddrinfo("metadata.google.internal", 80)
    # Reported once each, then cleared, so this test itself does not fail at teardown.
    found = netguard.new_violations()
    assert len(found) == 7 and all(any(a in v for v in found) for a in
                                   ("169.254.169.254", "2001:db8::1", "10.1.2.3", "8.8.8.8", "metadata.google.internal"))


def test_loopback_traffic_passes():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname(), timeout=5):
            pass
    assert socket.getaddrinfo("localhost", 80)
    assert netguard.new_violations() == []


def test_a_caught_violation_still_fails_the_test(tmp_path):
    # A library that swallows the error (as Ray does for its metadata probe) does not hide it.
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.netguard"]\n')
    (tmp_path / "test_leak.py").write_text(textwrap.dedent("""
        import socket

        def test_leaks():
            try:
                socket.create_connection(("169.254.169.254", 80), timeout=1)
            except OSError:
                pass
    """))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**__import__("os").environ, "PYTHONPATH": str(__import__("pathlib").Path.cwd())})
    assert out.returncode == 1, out.stdout[-2000:]
    assert "non-loopback network use during this test" in out.stdout and "169.254.169.254" in out.stdout
