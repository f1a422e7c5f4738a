"""Who may mark requests, and what each owner (uid, cgroup) may hold: the kernel side's maps
`mark_allow` and `budgets` (bpf/common.bpf.c, requests.bpf.c).

Any local process can issue the marker ioctl, so the per-process bounds are not enough: one user
with many processes or threads would fill req_by_tid, tgid_state and the ring buffer for everyone.
The kernel charges every begin to its uid and to its cgroup v2 (bpf_get_current_cgroup_id) and
refuses what is over either budget; with requests.mark_users / mark_cgroups set, only those mark,
exempt from the budgets, and the rest is counted (`mark_denied`) and dropped before any map write.
"""

from __future__ import annotations

import ctypes
import os
import pwd

from ..config import Config
from ..core import records as R

CGROUP2_MOUNTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
CGROUP2_SUPER_MAGIC = 0x63677270


class OwnerError(RuntimeError):
    """One line naming the setting and the value."""


def bpf_settings(cfg: Config) -> dict[str, int]:
    return {
        "MCP_MARK_RESTRICT": int(bool(cfg.requests_mark_users or cfg.requests_mark_cgroups)),
        "MCP_MAX_BEGINS_PER_S_UID": cfg.requests_max_begins_per_s_per_uid,
        "MCP_MAX_BEGINS_PER_S_CGROUP": cfg.requests_max_begins_per_s_per_cgroup,
        "MCP_MAX_OPEN_UID": cfg.requests_max_open_per_uid,
        "MCP_MAX_OPEN_CGROUP": cfg.requests_max_open_per_cgroup,
        "MCP_MAX_PROCS_UID": cfg.requests_max_procs_per_uid,
        "MCP_MAX_PROCS_CGROUP": cfg.requests_max_procs_per_cgroup,
    }


def cgroup2_root(mounts=CGROUP2_MOUNTS) -> str | None:
    """The cgroup v2 hierarchy: /sys/fs/cgroup (unified), or /sys/fs/cgroup/unified (hybrid, as on
    cgroup-v1 hosts). bpf_get_current_cgroup_id() answers in this hierarchy whichever it is."""
    for m in mounts:
        if os.path.isfile(os.path.join(m, "cgroup.controllers")):
            return m
    return None


def cgroup_id(path: str, root: str | None = None) -> int:
    """A cgroup v2 path (as in /proc/PID/cgroup's `0::` line) -> its id: the kernfs inode number
    of its directory, which bpf_get_current_cgroup_id() returns (kernel/cgroup: cgroup_id())."""
    root = root or cgroup2_root()
    if root is None:
        raise OwnerError("requests.mark_cgroups: no cgroup v2 hierarchy mounted (looked in "
                         + ", ".join(CGROUP2_MOUNTS) + ")")
    full = os.path.join(root, path.lstrip("/"))
    try:
        return os.stat(full).st_ino
    except OSError as e:
        raise OwnerError(f"requests.mark_cgroups: {path}: {e.strerror} ({full})") from None


def uid_of(user: str) -> int:
    if user.isascii() and user.isdigit():
        return int(user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        raise OwnerError(f"requests.mark_users: no such user {user!r}") from None


def allowed_owners(cfg: Config, root: str | None = None) -> list[tuple[int, int]]:
    """[(enum mcp_owner_kind, id)] for mark_allow. A cgroup that does not exist yet is an error: its
    id is the directory's inode, so a name cannot be allowed before the cgroup is made."""
    out = [(R.C["MCP_OWNER_UID"], uid_of(u)) for u in cfg.requests_mark_users]
    out += [(R.C["MCP_OWNER_CGROUP"], cgroup_id(p, root)) for p in cfg.requests_mark_cgroups]
    return out


def write_allow(bpf, owners: list[tuple[int, int]]) -> None:
    table = bpf[b"mark_allow"]
    for kind, ident in owners:
        table[R.OwnerKey(kind, 0, ident)] = ctypes.c_uint8(1)


BPF_EXIST = 2  # linux/bpf.h: update an entry only if it is still there


def update_existing(table, key, value) -> bool:
    """Write value only over an existing entry: an entry the kernel deleted meanwhile (the process
    exited, the owner was evicted) is not made again for nothing to remove."""
    from bcc.libbcc import lib

    return lib.bpf_update_elem(table.map_fd, ctypes.byref(key), ctypes.byref(value), BPF_EXIST) == 0


def release_open(bpf, ts) -> None:
    """A request closed from user space (idle expiry): give its owners' open slot back, as the
    kernel's close_request() does. A read-modify-write of the whole entry: a kernel update of the
    same owner in between is lost (user space has no atomic add on a map value); idle expiry is
    rare, and the counts are compared signed and saturate, so the error stays small."""
    if ts.exempt:
        return
    table = bpf[b"budgets"]
    for kind, ident in ((R.C["MCP_OWNER_UID"], ts.uid), (R.C["MCP_OWNER_CGROUP"], ts.cgroup_id)):
        key = R.OwnerKey(kind, 0, ident)
        b = table.get(key)
        if b is not None and ctypes.c_int32(b.open).value > 0:
            b.open -= 1
            update_existing(table, key, b)
