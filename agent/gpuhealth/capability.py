"""GPU and link health, the sources outside BPF: NVML sampler (nvml.py) and Xid events (xid.py), the
sysfs PCIe poller and downtraining judge (pcie/sysfs.py, pcie/episodes.py), NIC links over netlink
(nic/netlink.py); and the health tracepoints' records from BPF (health.bpf.c, decoded by
health_records.py): Xids from nvidia:nvidia_dev_xid (NVML's Xid events are then left off: the
fallback, so no Xid counts twice), AER errors into the judge, link changes as an immediate re-poll.

One object the core starts, ticks and stops (its capability hooks are at the end: routes,
evidence, instruments). Each source reports attached / missing with a reason (NVML absent, no
netlink) and the rest carry on. Everything here is read by the agent's thread from the sources' own
snapshots; no NVML call happens on the agent's thread. A link episode goes to its span
(pcie/telemetry.py) and to the listeners (the top snapshot).
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass

from ..core.capability import Evidence
from ..core.decode import TP_RAW, Route
from ..core.tracefs import RecordError
from ..nic import telemetry as nic_telemetry
from ..nic.netlink import NicWatcher
from ..pcie import telemetry as pcie_telemetry
from ..pcie.episodes import LINK_BUSY_UTIL_PCT, LinkEpisode, LinkJudge
from ..pcie.records import AerRecord, LinkEventRecord
from ..pcie.sysfs import PciePoller
from . import telemetry as T
from .health_records import HealthDecoder
from .nvml import NvmlSampler, normalize_bdf
from .xid import XidEvent, XidRecord, XidWatcher

log = logging.getLogger("mcp_hostagent")

KEEP_EVENTS = 256
REPOLL_MIN_NS = 100_000_000  # a burst of link events re-polls sysfs at most this often; the tick polls anyway


@dataclass(frozen=True)
class SourceStatus:
    name: str
    state: str  # attached | missing | disabled
    reason: str = ""


class GpuHealth:
    def __init__(self, *, enabled: bool = True, nic: bool = True, sample_period_s: float = 1.0,
                 slow_period_s: float = 10.0, busy_util_pct: float = LINK_BUSY_UTIL_PCT, nvml_module=None,
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
        self.tp = HealthDecoder()
        self.pcie_events: deque = deque(maxlen=KEEP_EVENTS)  # (name, t_ns, bdf, attributes) from tracepoints
        self.pcie_event_counts: Counter = Counter()  # (event, bdf) -> count
        self._polled_ns = 0
        self.links: pcie_telemetry.LinkEpisodeSpans | None = None  # once the agent has telemetry
        self.episode_listeners: list = []  # called with each LinkEpisode (the top snapshot)
        self.rejected: Counter = Counter()  # the agent's refusals by reason (records that do not fit)

    def start(self, bpf_xid: bool = False) -> list[SourceStatus]:
        """bpf_xid: the gpu_xid BPF probe is attached; NVML's Xid events would count each Xid again."""
        if not self.enabled:
            for name in ("nvml", "nvml_xid", "pcie_sysfs"):
                self.sources[name] = SourceStatus(name, "disabled", "gpu.enabled = false")
        else:
            ok = self.sampler.start()
            self.sources["nvml"] = SourceStatus("nvml", "attached" if ok else "missing",
                                                "" if ok else (self.sampler.reason or "NVML unavailable"))
            if bpf_xid:
                self.sources["nvml_xid"] = SourceStatus(
                    "nvml_xid", "disabled", "the gpu_xid BPF probe (nvidia:nvidia_dev_xid) delivers Xids; "
                    "NVML Xid events are its fallback")
            elif ok:
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

    def poll_links(self) -> list[LinkEpisode]:
        """Poll the links and judge them against NVML utilisation."""
        if self.sources.get("pcie_sysfs", SourceStatus("", "")).state != "attached":
            return []
        util = {s.pci_bus_id: s.util_gpu_pct for s in self.sampler.snapshot().values() if s.up}
        try:
            self.last_pcie = self.pcie.poll()
            self._polled_ns = self.last_pcie.t_ns
            return self._episodes(self.judge.update(self.last_pcie, util))
        except OSError as e:  # a device vanished mid-read: next poll sees it as gone
            log.debug("pcie poll: %s", e)
            return []

    def _episodes(self, episodes: list[LinkEpisode]) -> list[LinkEpisode]:
        for ep in episodes:
            if self.links is not None:
                self.links.on_episode(ep)
            for listen in self.episode_listeners:
                listen(ep)
        return episodes

    def on_tp_raw(self, rec) -> list[LinkEpisode]:
        """One decode.TpRaw from health.bpf.c, on the pipeline's thread. Raises tracefs.RecordError for a
        record that does not fit its format (the pipeline counts it)."""
        ev = self.tp.decode(rec)
        t_ns = rec.hdr.ts_ns  # bpf_ktime_get_ns(): CLOCK_MONOTONIC, as the NVML events' t_ns
        if isinstance(ev, XidRecord):
            self.on_xid(self._xid_event(t_ns, ev))
        elif isinstance(ev, AerRecord):
            bdf = normalize_bdf(ev.dev)
            self.judge.note_aer_event(bdf, ev.severity, ev.errors)
            self.pcie_event_counts[("aer_event", bdf)] += 1
            self.pcie_events.append(("mcp.pcie.aer_event", t_ns, bdf, {
                "mcp.pcie.bdf": bdf, "mcp.pcie.aer.kind": ev.severity, "mcp.pcie.aer.errors": list(ev.errors)}))
        elif isinstance(ev, LinkEventRecord):
            bdf = normalize_bdf(ev.port)
            self.pcie_event_counts[("pcie_link_event", bdf)] += 1
            self.pcie_events.append(("mcp.pcie.link_event", t_ns, bdf, ev.attributes()))
            if self.pcie._clock() - self._polled_ns >= REPOLL_MIN_NS:
                return self.poll_links()
        return []

    def _xid_event(self, t_ns: int, x: XidRecord) -> XidEvent:
        bdf = normalize_bdf(x.dev)
        gpu = next((s for s in self.sampler.snapshot().values() if normalize_bdf(s.pci_bus_id) == bdf), None)
        proc = x.process
        return XidEvent(t_ns, gpu.index if gpu else None, gpu.uuid if gpu else None, bdf, x.error_code,
                        source="bpf", msg=x.msg, pid=proc[0] if proc else None)

    def on_xid(self, ev: XidEvent) -> None:
        """An Xid from the BPF tracepoint: kept for request span events and top's findings, and counted
        in the one counts table (xid.counts, NVML's watcher's, idle when this source is live)."""
        self.xids.append(ev)
        self.xid.counts[ev.xid] = self.xid.counts.get(ev.xid, 0) + 1

    def tick(self) -> list[LinkEpisode]:
        """Poll the links, judge them against NVML utilisation; drain Xid and NIC events."""
        episodes = self.poll_links()
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
        """(name, t_ns, attributes) of Xid events on the process's GPUs (or naming it), PCIe tracepoint
        events on their paths, and NIC events in the window."""
        bdfs = set(self.gpus_of(pid).values())
        # NVML's Xid events carry no message: the attribute is left off (OTel drops None with a warning)
        out = [("mcp.gpu.xid", x.t_ns, {"mcp.gpu.xid": x.xid, "mcp.gpu.pci_bus_id": x.pci_bus_id or "",
                                        "mcp.gpu.xid.source": x.source,
                                        **({"mcp.gpu.xid.message": x.msg} if x.msg is not None else {})})
               for x in self.xids if t0_ns <= x.t_ns <= t1_ns
               and (normalize_bdf(x.pci_bus_id) in bdfs or (x.pid is not None and x.pid == pid))]
        paths = getattr(self.last_pcie, "paths", None) or {}
        on_path = {b for g in bdfs for b in (g, *paths.get(g, ()))}
        out += [(name, t, attrs) for name, t, bdf, attrs in self.pcie_events if t0_ns <= t <= t1_ns and bdf in on_path]
        out += [("mcp.nic.link_event", e.t_ns, e.attributes()) for e in self.nic_events if t0_ns <= e.t_ns <= t1_ns]
        return out

    # ---- as a capability of the core (core/capability.py) ----
    def routes(self) -> dict[int, Route]:
        return {t: r.with_handlers(self._on_record) for t, r in TP_RAW.items()}

    def _on_record(self, rec) -> None:
        try:
            self.on_tp_raw(rec)
        except RecordError:
            self.rejected["tracepoint_record"] += 1

    def attach_telemetry(self, telemetry) -> None:
        self.links = pcie_telemetry.LinkEpisodeSpans(telemetry)

    def evidence(self, fr) -> Evidence:
        """The request's window on its process's GPUs: link episodes, samples aggregated, events."""
        bdfs = set(self.gpus_of(fr.tgid).values())
        links = self.links.evidence(fr.begin_ns, fr.end_ns, bdfs) if self.links is not None else Evidence()
        return links + T.evidence(self, fr)

    def instruments(self) -> list:
        return [*T.instruments(self), *pcie_telemetry.instruments(self, self.links), *nic_telemetry.instruments(self)]

    def stop(self) -> None:
        for src in (self.sampler, self.xid, self.nics):
            if src is not None:
                try:
                    src.stop()
                except Exception as e:  # stopping must finish for the others
                    log.debug("stop %s: %s", type(src).__name__, e)
