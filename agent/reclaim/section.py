"""The reclaim capability's part of `top`'s snapshot: host memory and PSI (the kernel's own accounting),
kswapd per node, storms open and closed, reclaim stall rates per process, a request's stall time."""

from __future__ import annotations

from ..core.topology import numa_nodes
from ..telemetry.snapshot import KswapdView, ProcRow, Section, Tick, deltas, finding
from ..core.identity import sanitize_text
from . import memstat
from .telemetry import STALL_SPAN

RATES = ("direct_reclaim_ns", "memcg_reclaim_ns")


class ReclaimSection(Section):
    def __init__(self, kswapd, open_storms, proc_root: str = "/proc", sys_root: str = "/sys"):
        """kswapd: rule.KswapdTracker; open_storms() -> the rule's open Episodes."""
        self.kswapd, self.open_storms, self.proc_root = kswapd, open_storms, proc_root
        self._nodes = numa_nodes(sys_root)
        self._storms: dict[int, object] = {}  # id(episode) -> open Episode seen last tick
        self._opened: list = []

    def host(self, tick: Tick) -> dict:
        mem = memstat.parse_meminfo(memstat.read_text(f"{self.proc_root}/meminfo"))
        psi = memstat.read_psi(f"{self.proc_root}/pressure/memory")
        kswapd = []
        if self.kswapd is not None:
            for n in sorted(self._nodes | self.kswapd.nodes()):
                span_ns = int(tick.dt_s * 1e9)
                active = self.kswapd.active_ns(tick.now_ns - span_ns, tick.now_ns, n) / span_ns * 100 if span_ns > 0 else 0.0
                kswapd.append(KswapdView(n, n in self.kswapd.awake_since, round(min(active, 100.0), 1)))
        self._opened = list(self.open_storms())
        return {"mem_total_bytes": mem.get("MemTotal"), "mem_available_bytes": mem.get("MemAvailable"),
                "swap_total_bytes": mem.get("SwapTotal"), "swap_free_bytes": mem.get("SwapFree"),
                "psi_some_avg10": psi.get("some", {}).get("avg10"), "psi_full_avg10": psi.get("full", {}).get("avg10"),
                "kswapd": tuple(kswapd), "storm": bool(self._opened),
                "storm_scopes": tuple(sanitize_text(e.scope, 128) for e in self._opened)}

    def findings(self, tick: Tick) -> list:
        out = []
        now_open = {id(e): e for e in self._opened}
        for k, e in now_open.items():
            if k not in self._storms:
                out.append(finding(tick.to_wall(e.start_ns), "reclaim_storm_open", e.scope,
                                   f"reclaim storm opened: {e.scope}"))
        for k, e in self._storms.items():
            if k not in now_open:
                secs = max(0, e.end_ns - e.start_ns) / 1e9 if e.closed else 0
                out.append(finding(tick.to_wall(e.end_ns) if e.closed else tick.wall_ns, "reclaim_storm_close", e.scope,
                                   f"reclaim storm closed: {e.scope} after {secs:.0f}s, peak direct "
                                   f"{e.peak_direct_ms_per_s:.0f} ms/s, memcg {e.peak_memcg_ms_per_s:.0f} ms/s, "
                                   f"kswapd {e.peak_kswapd_ratio * 100:.0f}%"))
        self._storms = now_open
        return out

    def process(self, row: ProcRow) -> dict:
        d = deltas(row, RATES)
        return {} if d is None else {"reclaim_ms_per_s": (d["direct_reclaim_ns"] + d["memcg_reclaim_ns"]) / 1e6 / row.dt_s}

    def request(self, fr, span) -> dict:
        c = fr.counters
        stalls = sum(1 for ch in span.children if ch.name == STALL_SPAN) if span is not None else 0
        return {"reclaim_ms": (c.direct_reclaim_ns + c.memcg_reclaim_ns) / 1e6, "stalls": stalls}
