"""Watch every socket while a command runs: does anything reach past loopback?

    python3 bench/net_watch.py [--every 0.5] -- make test TESTS=tests/flows/test_cluster.py

Every `--every` seconds it reads /proc/net/{tcp,tcp6,udp,udp6} of this machine's own network namespace
and of every namespace a process below the command runs in (.ci/loopback makes one), and records each
socket whose remote address is neither loopback (127.0.0.0/8, ::1) nor unspecified (a listener).
At the end it prints one line per such address and namespace (none is the goal) and exits with the
command's exit code. It runs in the machine's namespace itself (it watches it), so it does not
`loopback.enter()`.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path


def decode(hexaddr: str) -> tuple[str, int]:
    ip, port = hexaddr.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1])), int(port, 16)
    addr = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return str(addr.ipv4_mapped or addr), int(port, 16)


def outside(ip: str) -> bool:
    a = ipaddress.ip_address(ip)
    return not (a.is_loopback or a.is_unspecified)


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def namespaces(root: int) -> dict[int, str]:
    """netns inode -> a /proc/<pid>/net folder in it: this machine's, and those below `root`."""
    found = {os.stat("/proc/self/ns/net").st_ino: "/proc/self/net"}
    for pid in descendants(root):
        try:
            found.setdefault(os.stat(f"/proc/{pid}/ns/net").st_ino, f"/proc/{pid}/net")
        except OSError:
            pass
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=0.5)
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    own = os.stat("/proc/self/ns/net").st_ino
    proc = subprocess.Popen(cmd)
    seen: dict[tuple[str, str, str, int], int] = {}
    polls, spaces = 0, set()
    while proc.poll() is None:
        for ino, net in namespaces(proc.pid).items():
            spaces.add(ino)
            for proto in ("tcp", "tcp6", "udp", "udp6"):
                try:
                    lines = Path(net, proto).read_text().splitlines()[1:]
                except OSError:
                    continue
                for line in lines:
                    ip, port = decode(line.split()[2])
                    if outside(ip):
                        key = ("machine" if ino == own else f"netns:{ino}", proto, ip, port)
                        seen[key] = seen.get(key, 0) + 1
        polls += 1
        time.sleep(args.every)
    print(f"net_watch: {polls} polls every {args.every:g} s over {len(spaces)} network namespace(s) "
          f"(this machine's and {len(spaces) - 1} below the command); exit code {proc.returncode}", file=sys.stderr)
    for (space, proto, ip, port), n in sorted(seen.items()):
        print(f"net_watch: {space} {proto} -> {ip}:{port} ({n} polls)", file=sys.stderr)
    if not seen:
        print("net_watch: no socket had a remote address outside loopback", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
