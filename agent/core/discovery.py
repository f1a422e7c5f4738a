"""Which processes get per-process counters: GPU processes, named pids and comms. Reads /proc only.

A GPU process is one that maps the CUDA driver (libcuda.so*) or an NVIDIA device node into its
address space; both show in /proc/PID/maps. Marked processes are added by the kernel itself on
their first request begin.

Any user's process is read here, so every read is bounded (procscan): the agent runs the scan on a
thread of its own in time-budgeted passes (WatchScan), never on the ring-buffer thread.
"""

from __future__ import annotations

import ctypes
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


WATCH_SCAN_S = 5.0  # between rounds of the watch scan
# One pass of the watch scan reads /proc for at most this long, then sleeps WATCH_GAP_S: a host whose
# users made /proc/PID/maps huge slows the scan's rounds, not the agent (docs/SECURITY.md, starving).
WATCH_PASS_S = 0.05
WATCH_GAP_S = 0.45  # (<= 10% of a core while a round lasts)


WATCH_BITS_WORDS = 4194304 // 64  # bpf/common.bpf.c MCP_WATCH_BITS_WORDS: tgids up to PID_MAX_LIMIT


def write_bits(bpf, now: set[int], before: set[int]) -> None:
    """The watch set as the kernel's watch_bits bitmap (the HTTP probes' cheap test): the words
    whose pids changed, each rewritten whole from `now`."""
    bits = bpf[b"watch_bits"]
    for word in {p >> 6 for p in now ^ before if p < WATCH_BITS_WORDS * 64}:
        v = 0
        for p in now:
            if p >> 6 == word:
                v |= 1 << (p & 63)
        bits[ctypes.c_uint32(word)] = ctypes.c_uint64(v)


class Watcher:
    """Keeps the kernel's watch_tgid map to the watch set: the first round whole at start (the processes
    already running are watched when start returns), the later ones on a thread of its own."""

    def __init__(self, cfg, proc_root: str, bpf_of, survived):
        """bpf_of: () -> the BPF object or None once stopping; survived(where, exc): counts a failure."""
        self.cfg, self.proc_root = cfg, proc_root
        self._bpf_of, self._survived = bpf_of, survived
        self._written: set[int] = set()  # pids this watcher put in watch_tgid
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.refresh(WatchScan(self.proc_root, budget_s=float("inf")))
        self._thread = threading.Thread(target=self._loop, name="mcp-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)  # a pass ends within WATCH_PASS_S plus one bounded read

    def _loop(self) -> None:
        scan = WatchScan(self.proc_root, budget_s=WATCH_PASS_S, stop=self._stop)
        while not self._stop.is_set():
            try:
                done = self.refresh(scan)
            except Exception as e:  # noqa: BLE001 -- the next round tries again
                self._survived("watch_scan", e)
                done = True
            self._stop.wait(WATCH_SCAN_S if done else WATCH_GAP_S)

    def refresh(self, scan: WatchScan) -> bool:
        """One pass of `scan`; when it completes a round, watch_tgid gets that round's set. True then."""
        cfg = self.cfg
        before = scan.result
        want = watch_set(self.proc_root, cfg.process_pids, cfg.process_comms, gpu=cfg.process_watch == "gpu", scan=scan)
        b = self._bpf_of()  # once: stop() may clear it meanwhile
        if want is before or b is None:
            return False
        table = b[b"watch_tgid"]
        follow = set()
        for pid in want:
            try:
                table[ctypes.c_uint32(pid)] = ctypes.c_uint8(1)
                follow.add(pid)
            except Exception as e:  # noqa: BLE001 -- watch_tgid full (E2BIG): counted, the rest still go in
                self._survived("watch_map_full", e)
        # A process that exited between the /proc walk and this write got an entry after its exit
        # had cleared it in the kernel: nothing else would remove it. Each refresh removes ours of
        # processes now gone (zombies included) and keeps following the rest.
        for pid in self._written - follow:
            if self._pid_gone(pid):
                table.pop(ctypes.c_uint32(pid), None)
            else:
                follow.add(pid)
        write_bits(b, follow, self._written)
        self._written = follow
        return True

    def _pid_gone(self, pid: int) -> bool:
        try:
            with open(f"{self.proc_root}/{pid}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
        except (OSError, IndexError):
            return True
