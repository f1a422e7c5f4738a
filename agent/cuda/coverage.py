"""When each launch probe was attached, and what share of a request's window that covers.

A duty-cycled launch probe counts only while attached. A request's count is then exact when the probe
was attached through the whole request, an estimate (hits / coverage) when it was attached for part
of it, and unknown when it was attached for none of it: a 0 there would be false (measured on the
H200: 31% of requests said 0 launches for 80). The kernel counts a request's hits unweighted
(bpf/cuda.bpf.c cu_launch_hit), so the estimate needs only the on-time inside the window.

Times are CLOCK_MONOTONIC seconds: time.monotonic() on Linux, the clock of bpf_ktime_get_ns().
"""

from __future__ import annotations

import threading
from collections import deque

KEEP_S = 120.0  # on-intervals kept: longer than requests.idle_expiry_s's default
EXACT = 0.9995  # coverage at or above: the probe was on for the whole window (clock slop aside)
NONE = 0.0005  # at or below: it was off for all of it


class OnLog:
    """Per probe key, its on-intervals: surely counting from the attach call's return to the detach
    call's start, maybe counting from the attach call's start (the probe may count before the call
    returns: measured here, a request 42% inside [return, detach] counted 26 hits, 13 ms' worth at
    2,000/s, of which 8.4 ms inside). Counting stops as the detach call starts: a request inside
    the release that follows (a perf-event uprobe waits out an RCU-tasks grace period, 40-90 ms in
    these VMs) counted none. Written by the duty cycler's and the finder's threads (attach/detach),
    read by the agent's thread (request evidence)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._closed: dict[object, deque] = {}
        self._open: dict[object, list] = {}  # key -> [attach call, on, detach call or None]

    def on(self, key, t_call: float, t_on: float) -> None:
        with self._lock:
            self._open[key] = [t_call, t_on, None]

    def closing(self, key, t_off: float) -> None:
        """The detach call starts: not surely counting from here, though its release may take a while
        (a request that ends meanwhile must not read as covered to now)."""
        with self._lock:
            if key in self._open:
                self._open[key][2] = t_off

    def off(self, key, t_done: float) -> None:
        with self._lock:
            opened = self._open.pop(key, None)
            if opened is None:
                return
            t_call, t_on, t_off = opened
            q = self._closed.setdefault(key, deque())
            q.append((t_call, t_on, t_done if t_off is None else t_off, t_done))
            while q and q[0][3] < t_done - KEEP_S:
                q.popleft()

    def forget(self, key) -> None:
        with self._lock:
            self._open.pop(key, None)
            self._closed.pop(key, None)

    def covered(self, key, t0: float, t1: float, now: float) -> tuple[float, float]:
        """Seconds of [t0, t1] the probe was surely on, and maybe on."""
        with self._lock:
            spans = list(self._closed.get(key, ()))
            if key in self._open:
                t_call, t_on, t_off = self._open[key]
                spans.append((t_call, t_on, now if t_off is None else t_off, now))
        sure = sum(max(0.0, min(c, t1) - max(b, t0)) for a, b, c, d in spans)
        maybe = sum(max(0.0, min(c, t1) - max(a, t0)) for a, b, c, d in spans)
        return sure, maybe


def apply(counts: dict[str, int], coverage: dict[str, tuple[float, float]]) -> tuple[dict[str, int | None], dict[str, float]]:
    """Per launch field: the exact count, an estimate or None (unknown); and the coverage of each
    field that is not exact. counts: field -> hits in the window; coverage: field -> (surely, maybe)
    share of the window its probe was on (fields absent: exact). Exact when surely on throughout;
    unknown (coverage 0) when never surely on: a window inside an attach call may or may not have
    been counted (on the H200 such requests read 0 or twice the truth); else hits / the mean of the
    two shares. Each symbol's probe has its own duty cycle, so each count has its own coverage."""
    out, cov_of = {}, {}
    for f, hits in counts.items():
        sure, maybe = coverage.get(f, (1.0, 1.0))
        if sure >= EXACT:
            out[f] = hits
            continue
        if sure <= NONE:
            out[f], cov_of[f] = None, 0.0
            continue
        cov = (sure + maybe) / 2
        out[f], cov_of[f] = round(hits / cov), cov
    return out, cov_of
