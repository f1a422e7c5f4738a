"""Reclaim storms: kswapd activity intervals and the episode rule. Pure: fed numbers, no I/O.

Episode rule (docs/TELEMETRY.md), evaluated on consecutive windows of `window_s` (1 s):
  hot(window)  = kswapd active >= kswapd_ratio of the window (any node)
                 or direct-reclaim stall >= direct_ms_per_s (host, all threads)
                 or memcg-reclaim stall >= memcg_ms_per_s (per scope: host, or one cgroup)
  open         after `open_windows` hot windows in a row (default 1); the episode starts at the
               first hot window's start
  close        after `close_windows` quiet windows in a row (default 3), where quiet means every
               signal is below half its threshold (hysteresis); the episode ends at the last hot
               window's end
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


class KswapdTracker:
    """Active intervals per node, from kswapd wake/sleep records (kernel monotonic ns)."""

    def __init__(self, keep: int = 4096):
        self.awake_since: dict[int, int] = {}
        self.intervals: deque[tuple[int, int, int]] = deque(maxlen=keep)  # (nid, start, end)
        self.seen: set[int] = set()  # nodes with a wake or sleep record since the probes attached

    def wake(self, nid: int, ts: int) -> None:
        self.seen.add(nid)
        self.awake_since.setdefault(nid, ts)

    def assume_awake(self, nid: int, since: int) -> bool:
        """A kswapd that used CPU although no record of it ever came was awake when the probes attached
        (mm_vmscan_kswapd_wake fires before each balance_pgdat() run, which lasts seconds under
        pressure): count it awake from `since` until its sleep record. True if this changed anything."""
        if nid in self.seen:
            return False
        self.seen.add(nid)
        self.awake_since[nid] = since
        return True

    def sleep(self, nid: int, ts: int) -> None:
        self.seen.add(nid)
        start = self.awake_since.pop(nid, None)
        if start is not None:
            self.intervals.append((nid, start, ts))

    def active_ns(self, t0: int, t1: int, nid: int | None = None) -> int:
        """Time kswapd (any node, or one) was awake within [t0, t1]; nodes summed when nid is None."""
        total = 0
        for n, a, b in self.intervals:
            if (nid is None or n == nid) and b > t0 and a < t1:
                total += min(b, t1) - max(a, t0)
        for n, a in self.awake_since.items():
            if (nid is None or n == nid) and a < t1:
                total += t1 - max(a, t0)
        return total

    def nodes(self) -> set[int]:
        return {n for n, _, _ in self.intervals} | set(self.awake_since)

    def forget_before(self, t: int) -> None:
        while self.intervals and self.intervals[0][2] < t:
            self.intervals.popleft()


@dataclass(frozen=True)
class Thresholds:
    kswapd_ratio: float = 0.5
    direct_ms_per_s: float = 10.0
    memcg_ms_per_s: float = 10.0
    open_windows: int = 1
    close_windows: int = 3


@dataclass
class Window:
    """One evaluation window's signals for one scope."""

    start_ns: int
    end_ns: int
    kswapd_ratio: float = 0.0  # max over nodes
    direct_stall_ns: int = 0
    memcg_stall_ns: int = 0
    context: dict = field(default_factory=dict)  # vmstat deltas, PSI: carried into the episode's peaks

    def rates(self) -> tuple[float, float, float]:
        secs = max(self.end_ns - self.start_ns, 1) / 1e9
        return self.kswapd_ratio, self.direct_stall_ns / 1e6 / secs, self.memcg_stall_ns / 1e6 / secs


@dataclass
class Episode:
    scope: str  # "host" or a cgroup path
    start_ns: int
    end_ns: int = 0
    windows: int = 0
    peak_kswapd_ratio: float = 0.0
    peak_direct_ms_per_s: float = 0.0
    peak_memcg_ms_per_s: float = 0.0
    totals: dict = field(default_factory=dict)  # summed context counters (pgscan_*, pgsteal_*, ...)
    peaks: dict = field(default_factory=dict)  # max context values (PSI avg10, ...)
    closed: bool = False
    hot: list = field(default_factory=list)  # (start_ns, end_ns) of its windows over the thresholds: its reclaim


class StormDetector:
    """One per scope. feed(window) -> ("open"|"update"|"close", episode) or None."""

    def __init__(self, scope: str, th: Thresholds = Thresholds()):
        self.scope, self.th = scope, th
        self.hot_run: list[Window] = []
        self.quiet = 0
        self.episode: Episode | None = None
        self.last_hot_end = 0

    def _hot(self, w: Window, factor: float = 1.0) -> bool:
        k, d, m = w.rates()
        th = self.th
        return k >= th.kswapd_ratio * factor or d >= th.direct_ms_per_s * factor or m >= th.memcg_ms_per_s * factor

    def _absorb(self, w: Window) -> None:
        e = self.episode
        k, d, m = w.rates()
        e.windows += 1
        e.peak_kswapd_ratio = max(e.peak_kswapd_ratio, k)
        e.peak_direct_ms_per_s = max(e.peak_direct_ms_per_s, d)
        e.peak_memcg_ms_per_s = max(e.peak_memcg_ms_per_s, m)
        for key, v in w.context.items():
            if key.startswith("psi_"):
                e.peaks[key] = max(e.peaks.get(key, v), v)
            else:
                e.totals[key] = e.totals.get(key, 0) + v

    def feed(self, w: Window):
        if self.episode is None:
            if not self._hot(w):
                self.hot_run.clear()
                return None
            self.hot_run.append(w)
            if len(self.hot_run) < self.th.open_windows:
                return None
            self.episode = Episode(self.scope, self.hot_run[0].start_ns)
            for hw in self.hot_run:
                self._absorb(hw)
                self.episode.hot.append((hw.start_ns, hw.end_ns))
            self.last_hot_end = w.end_ns
            self.hot_run.clear()
            self.quiet = 0
            return ("open", self.episode)
        self._absorb(w)
        if self._hot(w, 0.5):
            self.quiet = 0
            if self._hot(w):
                self.last_hot_end = w.end_ns
                self.episode.hot.append((w.start_ns, w.end_ns))
            return ("update", self.episode)
        self.quiet += 1
        if self.quiet < self.th.close_windows:
            return ("update", self.episode)
        e, self.episode = self.episode, None
        e.end_ns, e.closed = self.last_hot_end, True
        self.quiet = 0
        return ("close", e)


def in_reclaim(ep: Episode, t0: int, t1: int) -> bool:
    """Whether [t0, t1] overlaps one of the episode's hot windows: its reclaim, not the quiet windows
    that close it (a request begun after the storm's last hot window is not its victim)."""
    return any(a < t1 and b > t0 for a, b in ep.hot)
