"""The NVIDIA ioctl side: the syscall tracepoint's layout check, the fd-table scan's pieces, and the
ioctl and latency-histogram maps decoded into rows.

The kernel counts ioctls on fds listed in map nv_fds, which CudaProbes.scan_fds keeps from
/proc/PID/fd of watched processes every `fd_scan_s` (device_fds reads one process's, sync_fd_table
writes the difference). Not the ioctl type byte: on the H200 host nvidia-uvm's commands are bare
numbers (type 0x00) and /dev/nvidiactl and /dev/nvidiaN share type 'F' with no device told apart;
not fd -> file in BPF either, which would read kernel structs. An fd opened and used between two scans
is missed; a closed fd whose number is reused within a scan is counted as NVIDIA's until the next.
`device_globs` says what is NVIDIA's (tests register a file).
"""

from __future__ import annotations

import ctypes
import fnmatch
import os
import re
from typing import Callable

from . import records as R

TRACEFS = "/sys/kernel/tracing"


def syscall_layout_ok(tracefs: str = TRACEFS) -> str | None:
    """None when sys_enter_ioctl has fd at 16 and cmd at 24 (struct mcp_sys_enter_ioctl), else why not."""
    want = {"fd": 16, "cmd": 24}
    try:
        with open(f"{tracefs}/events/syscalls/sys_enter_ioctl/format") as f:
            text = f.read()
    except OSError as e:
        return f"tracepoint syscalls:sys_enter_ioctl not readable: {e.strerror}"
    for name, off in want.items():
        m = re.search(rf"field:[^;]*\b{name};\s*offset:(\d+);", text)
        if not m or int(m.group(1)) != off:
            return f"sys_enter_ioctl field {name} not at offset {off} (cuda.bpf.c's struct mcp_sys_enter_ioctl)"
    return None


# ---- the fd table (nv_fds) ----
def device_fds(proc: str, pid: int, device_globs: tuple[str, ...],
               device_id: Callable[[str], int]) -> dict[int, int]:
    """fd -> device id of pid's open fds whose target matches device_globs. Raises OSError when
    /proc/PID/fd cannot be listed (the process is gone)."""
    want: dict[int, int] = {}
    for fd in os.listdir(f"{proc}/{pid}/fd"):
        try:
            target = os.readlink(f"{proc}/{pid}/fd/{fd}")
        except OSError:
            continue
        if any(fnmatch.fnmatchcase(target, g) for g in device_globs):
            want[int(fd)] = device_id(target)
    return want


def sync_fd_table(table, pid: int, have: dict[int, int], want: dict[int, int]) -> None:
    """Bring map nv_fds from what it holds for pid (have) to what pid has open (want)."""
    for fd in have.keys() - want.keys():
        table.pop(R.NvFdKey(pid, fd), None)
    for fd, dev in want.items():
        if have.get(fd) != dev:
            table[R.NvFdKey(pid, fd)] = ctypes.c_uint32(dev)


# ---- rows from the maps (metrics, `mcp-agent probes`) ----
def ioctl_rows(nv_cmd, dev_ids: dict[str, int]) -> list[dict]:
    """Per process, device file and request code: count and ns (metric hostagent.nvidia.ioctl.*), from map
    nv_cmd; dev_ids: device path -> id as scan_fds numbered them."""
    names = {v: k for k, v in dev_ids.items()}
    return [{"pid": k.tgid, "device": names.get(k.dev, f"dev{k.dev}"), "cmd": f"0x{k.cmd:08x}",
             "type": f"0x{(k.cmd >> 8) & 0xff:02x}", "nr": k.cmd & 0xff, "count": v.count, "ns": v.ns}
            for k, v in nv_cmd.items()]


def hist_rows(cu_hist) -> list[dict]:
    """Per process and kind (ctx, sync, ioctl, alloc, free): log2 buckets from map cu_hist. Slot s
    holds [2^(s-1), 2^s - 1] ns (bcc's bpf_log2l is floor(log2) + 1), so le_ns = 2^s - 1."""
    return [{"pid": k.tgid, "kind": R.HIST_KINDS.get(k.kind, str(k.kind)), "slot": k.slot,
             "le_ns": (1 << k.slot) - 1, "count": v.value} for k, v in cu_hist.items()]
