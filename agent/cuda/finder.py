"""Finding libcuda in processes: /proc/PID/maps parsing, and reaching, checking and pinning the file a
process maps.

A process's libcuda is whatever /proc/PID/maps says it maps; in a container that is another file,
another inode, reached through /proc/PID/root/<path> (or /proc/PID/map_files/<range> when the path is
gone). A file is followed only if no user but root could have written it (agent/cuda/libtrust.py), and
from the check on it is read through an fd of the agent's own (pin). Uprobes bind to the inode, so
they are attached once per (device, inode): a Library. The walk over processes, the exec follow-up and
the library table itself are CudaProbes' (agent/cuda/capability.py); the budgets are here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from . import libtrust
from .symbols import SymState

MAX_REFUSED_KEPT = 1024  # refused (device, inode)s remembered, so each is checked once
CAP_REASON = "cuda.max_libraries"
# A user controls what their processes' maps cost to read (60,000 mappings: ~30 ms each): a pass over
# /proc spends at most RESCAN_BUDGET_S, one every RESCAN_PASS_S while a round lasts (<= 10% of a core);
# the exec checks get the same budget per RESCAN_PASS_S of their own.
RESCAN_BUDGET_S = 0.025
RESCAN_PASS_S = 0.25
# Once, at start (before READY=1): passes back to back until the first round ends or this much has gone,
# so that CUDA processes already running get their probes at start rather than a pass or more later
START_ROUND_S = 0.25

# ---- /proc parsing (pure) ----
_LIBCUDA = re.compile(r"(^|/)libcuda\.so(\.\d+)*$")


@dataclass(frozen=True)
class Mapping:
    start: str  # "7f..-7f.." range, for /proc/PID/map_files
    dev: tuple[int, int]  # (major, minor) as maps shows it
    inode: int
    path: str
    deleted: bool


def libcuda_mappings(maps: str) -> list[Mapping]:
    """The libcuda.so* file mappings in a /proc/PID/maps text, one per (device, inode)."""
    out: dict[tuple, Mapping] = {}
    if "libcuda.so" not in maps:
        return []
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or "libcuda.so" not in parts[5]:
            continue
        path, deleted = parts[5], parts[5].endswith(" (deleted)")
        if deleted:
            path = path[: -len(" (deleted)")]
        if not _LIBCUDA.search(path):
            continue
        major, minor = (int(x, 16) for x in parts[3].split(":"))
        key = (major, minor, int(parts[4]))
        out.setdefault(key, Mapping(parts[0], (major, minor), int(parts[4]), path, deleted))
    return list(out.values())


# ---- a followed file ----
@dataclass
class Library:
    key: tuple[int, int, int]  # (major, minor, inode) from maps
    path: str  # what bcc and the kernel open
    shown: str  # the path inside the process's mount namespace
    pids: set[int] = field(default_factory=set)
    syms: dict[str, SymState] = field(default_factory=dict)
    start: str = ""  # the mapping's range, for /proc/PID/map_files
    dropped: bool = False
    fd: int = -1  # the checked file, held open: `path` is /proc/self/fd/<fd> (pin)


def close_library(lib_: Library) -> None:
    if lib_.fd >= 0:
        os.close(lib_.fd)
        lib_.fd = -1


def pin(path: str, key: tuple) -> int:
    """An fd of the file just checked at path, verified to be that (device, inode): symbols are
    read and uprobes attached through /proc/self/fd/<fd> from here on, so a user who swaps what
    the path names after the check (a mount in their own namespace, a remapped range behind
    map_files) changes nothing the agent reads. O_NOFOLLOW but for map_files, whose entries
    are the kernel's links to the mapped file."""
    flags = os.O_RDONLY | os.O_CLOEXEC | (0 if "/map_files/" in path else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    st = os.fstat(fd)
    if (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) != tuple(key):
        os.close(fd)
        raise libtrust.Untrusted(f"{path}: not the file the process maps (replaced since the check)")
    return fd


def resolve(proc: str, pid: int, m: Mapping) -> str | None:
    """A path to the mapped file, to check and then pin: the agent's own view of the path when it
    is the same file (the host's libcuda), else through the process's root, else map_files (a
    deleted file, or overlayfs showing another inode). Raises libtrust.Untrusted for a file that
    a user other than root could have written (agent/cuda/libtrust.py). proc: the /proc to read."""
    if not m.deleted:
        for root in ("/", f"{proc}/{pid}/root"):
            c = m.path if root == "/" else root + m.path
            try:
                st = os.stat(c)
            except OSError:
                continue
            if st.st_ino == m.inode and (os.major(st.st_dev), os.minor(st.st_dev)) == m.dev:
                libtrust.check_path(root, m.path, m.dev, m.inode)
                return c
    c = f"{proc}/{pid}/map_files/{m.start}"
    if not os.path.exists(c):
        return None
    libtrust.check_open_file(c, m.path, m.dev, m.inode)
    return c


def trusted_libcuda(proc: str, pid: int, line: str) -> bool:
    """Whether a /proc/PID/maps line maps a libcuda file this finder would follow: resolve() finds it
    trusted and still the inode mapped. The watch scan's test of a GPU process by its libcuda
    (agent/core/discovery.py, handed this by agent/core/agent.py: the core imports no capability)."""
    try:
        return any(resolve(proc, pid, m) is not None for m in libcuda_mappings(line))
    except (libtrust.Untrusted, ValueError):  # ValueError: not a maps line
        return False
