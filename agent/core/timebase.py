"""Kernel monotonic time -> wall-clock time: the one place it happens.

bpf_ktime_get_ns() is CLOCK_MONOTONIC, the clock behind time.monotonic_ns() on Linux. The offset
to CLOCK_REALTIME is sampled as the tightest of several back-to-back reads, and re-sampled by
refresh() so that NTP steps reach spans within one refresh period.
"""

from __future__ import annotations

import time


def _sample_offset(rounds: int = 16) -> int:
    best = None
    for _ in range(rounds):
        m0 = time.monotonic_ns()
        w = time.time_ns()
        m1 = time.monotonic_ns()
        if best is None or m1 - m0 < best[0]:
            best = (m1 - m0, w - (m0 + m1) // 2)
    return best[1]


class Timebase:
    def __init__(self, offset_ns: int | None = None):
        self.offset_ns = _sample_offset() if offset_ns is None else offset_ns

    def refresh(self) -> None:
        self.offset_ns = _sample_offset()

    def to_wall_ns(self, mono_ns: int) -> int:
        """The only kernel-monotonic -> wall conversion in the agent."""
        return mono_ns + self.offset_ns
