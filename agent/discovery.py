"""Which processes get per-process counters: GPU processes, named pids and comms. Reads /proc only.

A GPU process is one that maps the CUDA driver (libcuda.so*) or an NVIDIA device node into its
address space; both show in /proc/PID/maps. Marked processes are added by the kernel itself on
their first request begin.
"""

from __future__ import annotations

import os


def _read(path: str, limit: int = 4 << 20) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:  # process gone or not ours to read: skip it this round
        return b""


def is_gpu_process(pid: int, proc_root: str = "/proc") -> bool:
    maps = _read(f"{proc_root}/{pid}/maps")
    return b"libcuda.so" in maps or b"/dev/nvidia" in maps


def watch_set(proc_root: str = "/proc", pids=(), comms=(), gpu: bool = True) -> set[int]:
    want_comms = {c.encode() if isinstance(c, str) else c for c in comms}
    out = {p for p in pids if os.path.isdir(f"{proc_root}/{p}")}
    if not (want_comms or gpu):
        return out
    for name in os.listdir(proc_root):
        if not name.isdigit():
            continue
        pid = int(name)
        if want_comms and _read(f"{proc_root}/{pid}/comm").rstrip(b"\n") in want_comms:
            out.add(pid)
        elif gpu and is_gpu_process(pid, proc_root):
            out.add(pid)
    return out
