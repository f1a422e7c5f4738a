"""GPU and link health, the sources outside BPF: NVML sampler and Xid events (nvml.py), the sysfs PCIe
poller and downtraining judge (pcie.py), NIC links over netlink (netlink.py).

One object the pipeline starts, ticks and stops. Each source reports attached / missing with a
reason (NVML absent, no netlink) and the rest carry on. Everything here is read by the pipeline's
thread from the sources' own snapshots; no NVML call happens on the pipeline's thread.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass

from .netlink import NicWatcher
from .nvml import NvmlSampler, XidWatcher, normalize_bdf
from .pcie import LinkEpisode, PciePoller, LinkJudge

log = logging.getLogger("mcp_hostagent")

KEEP_EVENTS = 256


@dataclass(frozen=True)
class SourceStatus:
    name: str
    state: str  # attached | missing | disabled
    reason: str = ""


class GpuHealth:
    def __init__(self, *, enabled: bool = True, nic: bool = True, sample_period_s: float = 1.0,
                 slow_period_s: float = 10.0, busy_util_pct: float = 10.0, nvml_module=None,
                 sysfs_root: str = "/sys"):
        self.enabled, self.nic_enabled = enabled, nic
        self.sampler = NvmlSampler(nvml_module, period_s=sample_period_s, slow_period_s=slow_period_s)
        self.xid = XidWatcher(nvml_module)
        self.pcie = PciePoller(sysfs_root)
        self.judge = LinkJudge(busy_util_pct=busy_util_pct)
        self.nics = NicWatcher(sysfs_root=sysfs_root) if nic else None
        self.sources: dict[str, SourceStatus] = {}
        self.xids: deque = deque(maxlen=KEEP_EVENTS)  # recent XidEvent, for request span events
        self.nic_events: deque = deque(maxlen=KEEP_EVENTS)
        self.nic_counts: Counter = Counter()  # (ifname, kind) -> count
        self.last_pcie = None

    def start(self) -> list[SourceStatus]:
        if not self.enabled:
            for name in ("nvml", "nvml_xid", "pcie_sysfs"):
                self.sources[name] = SourceStatus(name, "disabled", "gpu.enabled = false")
        else:
            ok = self.sampler.start()
            self.sources["nvml"] = SourceStatus("nvml", "attached" if ok else "missing",
                                                "" if ok else (self.sampler.reason or "NVML unavailable"))
            if ok:
                xok = self.xid.start()
                self.sources["nvml_xid"] = SourceStatus("nvml_xid", "attached" if xok else "missing",
                                                        "" if xok else (self.xid.reason or "no Xid events"))
            else:
                self.sources["nvml_xid"] = SourceStatus("nvml_xid", "missing", "needs NVML")
            try:
                self.last_pcie = self.pcie.poll()
                self.sources["pcie_sysfs"] = SourceStatus("pcie_sysfs", "attached")
            except OSError as e:
                self.sources["pcie_sysfs"] = SourceStatus("pcie_sysfs", "missing", f"read /sys/bus/pci: {e}")
        if self.nics is None:
            self.sources["nic_netlink"] = SourceStatus("nic_netlink", "disabled", "nic.enabled = false")
        else:
            ok = self.nics.start()
            self.sources["nic_netlink"] = SourceStatus("nic_netlink", "attached" if ok else "missing",
                                                       "" if ok else (getattr(self.nics, "reason", None) or "netlink unavailable"))
        return list(self.sources.values())

    def tick(self) -> list[LinkEpisode]:
        """Poll the links, judge them against NVML utilisation; drain Xid and NIC events."""
        episodes: list[LinkEpisode] = []
        if self.sources.get("pcie_sysfs", SourceStatus("", "")).state == "attached":
            util = {s.pci_bus_id: s.util_gpu_pct for s in self.sampler.snapshot().values() if s.up}
            try:
                self.last_pcie = self.pcie.poll()
                episodes = self.judge.update(self.last_pcie, util)
            except OSError as e:  # a device vanished mid-read: next poll sees it as gone
                log.debug("pcie poll: %s", e)
        if self.sources.get("nvml_xid", SourceStatus("", "")).state == "attached":
            self.xids.extend(self.xid.drain())
        if self.nics is not None and self.sources["nic_netlink"].state == "attached":
            for ev in self.nics.drain():
                self.nic_events.append(ev)
                self.nic_counts[(ev.ifname, ev.kind)] += 1
        return episodes

    def gpus_of(self, pid: int) -> dict[int, str]:
        """GPU index -> PCI address of the GPUs the process has contexts on (NVML's process lists)."""
        snap = self.sampler.snapshot()
        return {i: snap[i].pci_bus_id for i in self.sampler.gpus_for_pid(pid) if i in snap}

    def request_attributes(self, pid: int, t0_ns: int, t1_ns: int) -> dict:
        """GPU samples overlapping the request, for each GPU the process uses (first one flat,
        others as mcp.gpu.<index>.*)."""
        attrs: dict = {}
        for n, gpu in enumerate(sorted(self.gpus_of(pid))):
            agg = self.sampler.aggregate(gpu, t0_ns, t1_ns, pid=pid)
            if agg is not None:
                attrs.update(agg.attributes("mcp.gpu" if n == 0 else f"mcp.gpu.{gpu}"))
        return attrs

    def events_between(self, pid: int, t0_ns: int, t1_ns: int) -> list[tuple[str, int, dict]]:
        """(name, t_ns, attributes) of Xid events on the process's GPUs and NIC events in the window."""
        bdfs = set(self.gpus_of(pid).values())
        out = [("mcp.gpu.xid", x.t_ns, {"mcp.gpu.xid": x.xid, "mcp.gpu.pci_bus_id": x.pci_bus_id or ""})
               for x in self.xids if t0_ns <= x.t_ns <= t1_ns and normalize_bdf(x.pci_bus_id) in bdfs]
        out += [("mcp.nic.link_event", e.t_ns, e.attributes()) for e in self.nic_events if t0_ns <= e.t_ns <= t1_ns]
        return out

    def stop(self) -> None:
        for src in (self.sampler, self.xid, self.nics):
            if src is not None:
                try:
                    src.stop()
                except Exception as e:  # stopping must finish for the others
                    log.debug("stop %s: %s", type(src).__name__, e)
