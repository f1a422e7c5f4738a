"""Bounded reads of /proc for scans over every process.

Any local user controls what their processes' /proc files cost to read: 60,000 mappings make one
/proc/PID/maps ~3 MB and ~30 ms of kernel time to read, and 36 such processes made the agent's watch
scan take a core (docs/SECURITY.md, "Threat model: crashes and starving"). So a scan over all processes
reads a bounded prefix of each file (MAPS_LIMIT), stops reading at the first hit (maps_contains) or
when its caller has seen enough (maps_lines, a generator the caller stops), and spends a bounded wall
time per pass (Walker), resuming where it stopped; whoever loops over passes sleeps between them.
"""

from __future__ import annotations

import os
import threading
import time

MAPS_LIMIT = 4 << 20  # bytes of one /proc/PID/maps read at most
CHUNK = 64 << 10  # the kernel formats maps a page of lines per read call; bigger buys nothing

_lock = threading.Lock()
_truncated = 0  # maps reads cut at their limit, process-wide (several threads scan)


def truncated_reads() -> int:
    """How many maps reads (read_maps, maps_contains) stopped at their limit, since import."""
    return _truncated


def _count_truncated() -> None:
    global _truncated
    with _lock:
        _truncated += 1


def _chunks(pid: int, proc_root: str, limit: int):
    """The maps file in CHUNK reads, at most `limit` bytes; counts a read cut at the limit."""
    try:
        with open(f"{proc_root}/{pid}/maps", "rb", buffering=0) as f:
            left = limit
            while left > 0:
                c = f.read(min(CHUNK, left))
                if not c:
                    return
                left -= len(c)
                yield c
            if f.read(1):
                _count_truncated()
    except OSError:  # gone, or not ours to read (a scan skips it this round)
        return


def read_maps(pid: int, proc_root: str = "/proc", limit: int = MAPS_LIMIT) -> bytes:
    """At most `limit` bytes of /proc/PID/maps, b"" when unreadable/gone. Reads in chunks; stops early."""
    return b"".join(_chunks(pid, proc_root, limit))


def maps_contains(pid: int, needles: tuple[bytes, ...], proc_root: str = "/proc", limit: int = MAPS_LIMIT) -> bool:
    """Whether any needle occurs in the first `limit` bytes of /proc/PID/maps; reading stops at the first
    hit. A needle split across two reads is found: each read is searched with the previous one's tail."""
    keep = max(map(len, needles), default=1) - 1
    tail = b""
    for c in _chunks(pid, proc_root, limit):
        buf = tail + c
        if any(n in buf for n in needles):
            return True
        tail = buf[-keep:] if keep else b""
    return False


def maps_lines(pid: int, needles: tuple[bytes, ...], proc_root: str = "/proc", limit: int = MAPS_LIMIT):
    """The whole lines of the first `limit` bytes of /proc/PID/maps that contain a needle, in order (a
    line the limit cuts is dropped). A generator: the caller that has seen enough stops it, and the
    reading stops there. A read without a needle is skipped whole; only a read with one is split."""
    rest = b""
    for c in _chunks(pid, proc_root, limit):
        buf = rest + c
        cut = buf.rfind(b"\n") + 1
        whole, rest = buf[:cut], buf[cut:]
        if any(n in whole for n in needles):
            for line in whole.split(b"\n"):
                if any(n in line for n in needles):
                    yield line


def list_pids(proc_root: str = "/proc") -> list[int]:
    return sorted(int(n) for n in os.listdir(proc_root) if n.isdigit())


class Walker:
    """Round-robin over /proc pids, spending at most `budget_s` of wall time per pass (default 0.05) and
    resuming where the last pass stopped; stop-aware.

    A round is the pids /proc listed when it began; a pid born during a round is visited in the next.
    Each pass visits at least one pid, so a round always ends; one visit may overrun the budget by what
    that visit costs (read_maps bounds a maps read)."""

    def __init__(self, proc_root: str = "/proc", budget_s: float = 0.05, stop: threading.Event | None = None):
        self.proc_root = proc_root
        self.budget_s = budget_s
        self.stop = stop
        self._pids: list[int] = []
        self._next = 0  # index into _pids; == len: the next pass lists /proc afresh
        self._stats = {"passes": 0, "rounds": 0, "pids_visited": 0, "budget_exhausted": 0, "list_failed": 0}

    @property
    def stats(self) -> dict:
        """passes, rounds, pids_visited, budget_exhausted (passes cut by the budget), list_failed (/proc
        not listable: EMFILE, ENOMEM) of this walker, and truncated_reads: process-wide maps reads cut at
        their limit (truncated_reads())."""
        return {**self._stats, "truncated_reads": truncated_reads()}

    def walk(self, visit) -> bool:
        """Call visit(pid) for pids in order from the saved cursor until budget spent or stop set; returns True when a
        full round of all pids has completed since the last True (so callers know their view is complete)."""
        st = self._stats
        st["passes"] += 1
        deadline = time.monotonic() + self.budget_s
        if self._next >= len(self._pids):
            try:
                self._pids, self._next = list_pids(self.proc_root), 0
            except OSError:  # a round that saw no pid is not a complete view; the next pass retries
                st["list_failed"] += 1
                return False
        first = True
        while self._next < len(self._pids):
            if self.stop is not None and self.stop.is_set():
                return False
            if not first and time.monotonic() >= deadline:
                st["budget_exhausted"] += 1
                return False
            first = False
            pid = self._pids[self._next]
            self._next += 1  # before visit: a visit that raises does not pin the cursor on its pid
            st["pids_visited"] += 1
            visit(pid)
        st["rounds"] += 1
        return True
