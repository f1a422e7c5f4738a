"""Which processes get per-process counters: GPU processes, named pids and comms. Reads /proc only.

A GPU process is one that maps the CUDA driver (libcuda.so*) or an NVIDIA device node into its
address space; both show in /proc/PID/maps. Marked processes are added by the kernel itself on
their first request begin.

Any user's process is read here, so every read is bounded (procscan): the agent runs the scan on a
thread of its own in time-budgeted passes (WatchScan), never on the ring-buffer thread.
"""

from __future__ import annotations

import math
import os
import threading

from . import procscan

GPU_NEEDLES = (b"libcuda.so", b"/dev/nvidia")


def _read(path: str, limit: int = 4096) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:  # process gone or not ours to read: skip it this round
        return b""


def is_gpu_process(pid: int, proc_root: str = "/proc") -> bool:
    return procscan.maps_contains(pid, GPU_NEEDLES, proc_root)


class WatchScan:
    """A watch scan carried across time-budgeted passes: the walker's cursor and this round's finds."""

    def __init__(self, proc_root: str = "/proc", budget_s: float = 0.05, stop: threading.Event | None = None):
        self.walker = procscan.Walker(proc_root, budget_s, stop)
        self.found: set[int] = set()
        self.result: set[int] = set()  # the last complete round's


def watch_set(proc_root: str = "/proc", pids=(), comms=(), gpu: bool = True, scan: WatchScan | None = None) -> set[int]:
    """The processes to watch. Without `scan`, one full walk of /proc. With it, one budgeted pass of that
    scan: the set of its last complete round, a new object each time a round completes."""
    want_comms = {c.encode() if isinstance(c, str) else c for c in comms}
    if scan is None:
        scan = WatchScan(proc_root, budget_s=math.inf)
    if want_comms or gpu:
        def visit(pid: int) -> None:
            if want_comms and _read(f"{proc_root}/{pid}/comm").rstrip(b"\n") in want_comms:
                scan.found.add(pid)
            elif gpu and is_gpu_process(pid, proc_root):
                scan.found.add(pid)

        if not scan.walker.walk(visit):
            return scan.result
    scan.result = scan.found | {p for p in pids if os.path.isdir(f"{proc_root}/{p}")}
    scan.found = set()
    return scan.result
