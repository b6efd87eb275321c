"""The kernel calls the sandbox is made of: namespaces (unshare), mounts, resource limits, a distinct uid.

Linux only, through libc with ctypes (Python 3.11 has no os.unshare). Each function raises OSError with the
call and errno's text when the kernel refuses.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import resource
from collections.abc import Iterable
from pathlib import Path

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS, PR_SET_PDEATHSIG = 38, 1

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


def _check(result: int, what: str) -> None:
    if result != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), f"unshare({flags:#x})")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {source or ''} on {target}")


def prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})")


def hide(paths: Iterable[str | Path], keep: Iterable[str | Path], tmp_size_mb: int) -> None:
    """In this process's own mount namespace (call `unshare(CLONE_NEWNS)` first), cover each of `paths` with an
    empty tmpfs, then put each of `keep` back, read-only, where it was (a folder under a covered one, such as
    Python's standard library under a home folder). Folders that do not exist are skipped; a path inside another
    covered path is covered with it."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the host's mounts
    kept = {str(k): os.open(k, os.O_PATH) for k in keep if os.path.isdir(k)}  # opened before they are covered
    covered: list[str] = []
    for path in sorted({os.path.realpath(p) for p in paths if os.path.isdir(p)}, key=len):
        if any(path == c or path.startswith(c + "/") for c in covered):
            continue
        sticky = path in ("/tmp", "/var/tmp", "/dev/shm")
        mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV,
              f"mode={'1777' if sticky else '0755'},size={tmp_size_mb}m")
        covered.append(path)
    for path, fd in kept.items():
        if any(path.startswith(c + "/") for c in covered):
            os.makedirs(path, exist_ok=True)
            mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
            mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(fd)


def set_limits(*, cpu_seconds: int, memory_mb: int, processes: int, open_files: int, file_size_mb: int) -> None:
    """Hard limits on this process and what it starts: CPU time (SIGXCPU, then SIGKILL), address space, processes of
    its uid, open files, bytes written to any one file (SIGXFSZ), and no core files."""
    for limit, value in ((resource.RLIMIT_CPU, cpu_seconds), (resource.RLIMIT_AS, memory_mb << 20),
                         (resource.RLIMIT_NPROC, processes), (resource.RLIMIT_NOFILE, open_files),
                         (resource.RLIMIT_FSIZE, file_size_mb << 20), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))


def become(uid: int) -> None:
    """Drop to `uid` (and the same gid), no supplementary groups, no way back up (no_new_privs)."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    if os.getuid() != uid or os.geteuid() != uid:
        raise OSError(errno.EPERM, f"still uid {os.geteuid()} after setuid({uid})")
