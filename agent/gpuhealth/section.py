"""The GPU health capability's part of `top`'s snapshot: each GPU's NVML figures (read from the
sampler's published snapshot, never from NVML itself), Xid counts and findings, a process's GPUs."""

from __future__ import annotations

from collections import deque

from ..core.identity import sanitize_text
from ..telemetry.snapshot import Section, Tick, finding


def _r(x, nd: int = 1):
    return None if x is None else round(x, nd)


class GpuSection(Section):
    def __init__(self, sampler, xid=None, xids=None, sources=None):
        """sampler: nvml.NvmlSampler; xid: its XidWatcher (counts); xids: the capability's deque of recent
        XidEvents (BPF and NVML); sources: its SourceStatus by name."""
        self.sampler, self.xid, self.xids = sampler, xid, xids if xids is not None else ()
        self.sources = sources if sources is not None else {}
        self._samples: dict = {}
        self._seen: set[int] = set()
        self._new: deque = deque(maxlen=1024)
        self._by_gpu: dict = {}  # GPU index (or PCI address) -> [count, last xid]
        self._pending: list = []  # this tick's Xid findings

    def gpus(self, tick: Tick) -> dict:
        try:
            self._samples = dict(self.sampler.snapshot()) if self.sampler is not None else {}
        except Exception:  # a sampler in a bad state must not cost the tick
            self._samples = {}
        recent = list(self.xids)  # a bounded deque of XidEvents: take the new ones
        seen = {id(e) for e in recent}
        self._new.extend(e for e in recent if id(e) not in self._seen)
        self._seen = seen
        while self._new:
            ev = self._new.popleft()
            key = ev.gpu_index if ev.gpu_index is not None else (ev.pci_bus_id or "?")
            rec = self._by_gpu.setdefault(key, [0, 0])
            rec[0] += 1
            rec[1] = ev.xid
            self._pending.append(finding(tick.wall_ns, "xid", f"gpu{key}", f"Xid {ev.xid} on GPU {key}"))
        out = {}
        for i, s in sorted(self._samples.items()):
            xid = self._by_gpu.get(i) or self._by_gpu.get(s.pci_bus_id)
            power = s.power_mw / 1000 if s.power_mw is not None else None
            out[s.pci_bus_id] = {
                "index": i, "uuid": s.uuid, "up": s.up,
                "down_reason": sanitize_text(s.down_reason, 120) if s.down_reason else None,
                "util_pct": s.util_gpu_pct, "mem_util_pct": s.util_mem_pct, "mem_used_bytes": s.mem_used_bytes,
                "mem_total_bytes": s.mem_total_bytes, "sm_clock_mhz": s.sm_clock_mhz, "mem_clock_mhz": s.mem_clock_mhz,
                "throttle": tuple(s.throttle_reasons), "power_w": _r(power), "temperature_c": s.temperature_c,
                "replay_count": s.pcie_replay_count, "xid_count": xid[0] if xid else None,
                "last_xid": xid[1] if xid else None}
        return out

    def host(self, tick: Tick) -> dict:
        xid_total = None
        if self.xid is not None and isinstance(getattr(self.xid, "counts", None), dict):
            xid_total = sum(self.xid.counts.values())
        elif self._by_gpu:
            xid_total = sum(v[0] for v in self._by_gpu.values())
        src = self.sources.get("nvml")
        try:
            samples = self.sampler.snapshot() if self.sampler is not None else {}
        except Exception:
            samples = {}
        if samples:
            state = "ok"
        elif src is not None and src.state != "attached":
            state = sanitize_text(f"{src.state}: {src.reason}", 160)
        elif self.sampler is None:
            state = "not wired"
        else:
            state = sanitize_text(getattr(self.sampler, "reason", None) or "no samples yet", 160)
        return {"xid_total": xid_total, "nvml": state}

    def findings(self, tick: Tick) -> list:
        out, self._pending = self._pending, []
        return out

    def process_gpus(self, pid: int) -> tuple[int, ...]:
        if not self._samples:
            return ()
        try:
            return tuple(self.sampler.gpus_for_pid(pid))
        except Exception:
            return ()
