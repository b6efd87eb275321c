"""The suite's network guard and its clean exit (a pytest plugin, loaded by tests/conftest.py).

1. **Loopback only.** `make test` runs pytest in a network namespace of its own (.ci/loopback), where
   nothing can leave the machine. This guard also works where no namespace can be made: in the test
   process, a connect, a datagram or a name lookup aimed past 127.0.0.0/8 (or ::1) raises
   `NonLoopbackError` before anything is sent, and the test during which it happened fails, naming
   the address, even if a library caught the error. Names are allowed only when /etc/hosts maps them
   to loopback ("localhost" always): any other lookup would query a DNS server.
   Processes the tests start (Ray, Prefect, uvicorn, Chromium) are outside this guard; the
   namespace covers them.
2. **Servers die with the suite.** A SIGTERM to pytest (alone, or to the process group of `make test`)
   becomes a KeyboardInterrupt, so pytest tears its fixtures down as after Ctrl-C; a second one is
   ignored so the teardown can finish. When pytest exits, every process it started and that is
   still running (servers in sessions of their own included) gets SIGTERM, then SIGKILL. Servers
   the tests start in sessions of their own also get PR_SET_PDEATHSIG (`die_with_parent`), for
   when pytest itself is killed with SIGKILL.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


class NonLoopbackError(OSError):
    """Raised instead of sending anything to an address outside 127.0.0.0/8 and ::1."""


_violations: list[str] = []
_lock = threading.Lock()
_checked = 0
_real: dict[str, Callable[..., Any]] = {}


def _hosts_file() -> dict[str, set[str]]:
    names: dict[str, set[str]] = {}
    try:
        lines = Path("/etc/hosts").read_text().splitlines()
    except OSError:
        return names
    for line in lines:
        fields = line.split("#", 1)[0].split()
        for name in fields[1:]:
            names.setdefault(name.lower(), set()).add(fields[0])
    return names


_HOSTS = _hosts_file()


def _loopback_ip(text: str) -> bool | None:
    """True/False for an IP literal (unspecified counts: connecting to it reaches this host), None for a name."""
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified


def loopback_host(host: Any) -> bool:
    """Whether reaching `host` (an IP literal or a name) stays on this machine without a DNS query."""
    if host is None or host in ("", b""):
        return True
    if isinstance(host, bytes):
        host = host.decode()
    host = str(host)
    literal = _loopback_ip(host)
    if literal is not None:
        return literal
    name = host.lower().rstrip(".")
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    addresses = _HOSTS.get(name)
    return bool(addresses) and all(_loopback_ip(a) for a in addresses)


def _refuse(what: str, target: Any) -> None:
    message = f"{what} {target!r}: the test suite may only reach 127.0.0.0/8 (tests/netguard.py)"
    if os.environ.get("RLOPS_NETGUARD_TRACE"):
        import traceback

        message += "\n" + "".join(traceback.format_stack(limit=25))
    with _lock:
        _violations.append(message)
    raise NonLoopbackError(message)


def _check_address(sock: socket.socket, address: Any, what: str) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6) and isinstance(address, tuple) and address:
        if not loopback_host(address[0]):
            _refuse(what, address)


def _install() -> None:
    if _real:
        return
    _real.update(connect=socket.socket.connect, connect_ex=socket.socket.connect_ex, sendto=socket.socket.sendto,
                 getaddrinfo=socket.getaddrinfo, gethostbyname=socket.gethostbyname,
                 gethostbyname_ex=socket.gethostbyname_ex)

    def connect(self: socket.socket, address: Any) -> None:
        _check_address(self, address, "connect to")
        return _real["connect"](self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        _check_address(self, address, "connect to")
        return _real["connect_ex"](self, address)

    def sendto(self: socket.socket, data: Any, *args: Any) -> int:
        _check_address(self, args[-1], "datagram to")
        return _real["sendto"](self, data, *args)

    def lookup(name: str) -> Callable[..., Any]:
        def guarded(host: Any, *args: Any, **kwargs: Any) -> Any:
            if not loopback_host(host):
                _refuse("name lookup of", host)
            return _real[name](host, *args, **kwargs)

        return guarded

    socket.socket.connect = connect  # type: ignore[method-assign]
    socket.socket.connect_ex = connect_ex  # type: ignore[method-assign]
    socket.socket.sendto = sendto  # type: ignore[method-assign]
    for name in ("getaddrinfo", "gethostbyname", "gethostbyname_ex"):
        setattr(socket, name, lookup(name))


def new_violations() -> list[str]:
    """Violations since the last call (each is reported once, by the test during which it happened)."""
    global _checked
    with _lock:
        found, _checked = _violations[_checked:], len(_violations)
    return found


# -- clean exit --------------------------------------------------------------------------------

_started: set[int] = set()  # pids seen below pytest when it was asked to stop


def _descendants() -> set[int]:
    import psutil

    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


def _on_sigterm(signum: int, frame: Any) -> None:
    _started.update(_descendants())  # before teardown re-parents anything out of reach
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one (e.g. forwarded by .ci/loopback) must not cut the teardown
    raise KeyboardInterrupt("SIGTERM")


def die_with_parent() -> None:
    """`preexec_fn` for a server a test starts in a session of its own: it gets SIGTERM when the thread
    that started it exits, even if pytest is killed with SIGKILL (Linux PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def stop_leftovers(grace_s: float = 10.0) -> list[int]:
    """SIGTERM, then SIGKILL after `grace_s`, every process started below pytest that still runs."""
    import psutil

    procs = []
    for pid in _started | _descendants():
        try:
            proc = psutil.Process(pid)
            proc.terminate()
            procs.append(proc)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    return [p.pid for p in procs]


# -- pytest hooks --------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    _install()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    # At exit, after the libraries' own exit handlers (registered later, so run earlier): `ray.shutdown`
    # must find its raylet alive, or the process exits with status 1.
    atexit.register(stop_leftovers)


@pytest.fixture(autouse=True)
def _loopback_only() -> Any:
    yield  # what happened since the last test's check (this test's fixtures' setup included) fails this one
    found = new_violations()
    if found:
        pytest.fail("non-loopback network use during this test:\n  " + "\n  ".join(found), pytrace=False)


def in_namespace() -> bool:
    """Whether this process runs in the network namespace .ci/loopback made (only `lo` exists)."""
    return os.environ.get("RLOPS_LOOPBACK") == "1" and Path("/proc/net/dev").read_text().count(":") == 1
