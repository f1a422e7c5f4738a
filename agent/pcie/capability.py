"""PCIe: link state and AER counters of each GPU's path from sysfs, the downtraining rule, and the
AER / link-change tracepoint records (bpf/pcie.bpf.c's raw copies, decoded by the core with their
run-time formats) -> link episode spans that requests on that GPU link to, events and metrics.

The judge needs each GPU's utilisation (a slow link only counts under load) and a request's GPUs:
both come from NVML, as the inputs gpu.util_by_bdf and gpu.gpus_of (gpuhealth provides them).
"""

from __future__ import annotations

import logging
from collections import Counter, deque

from ..core.capability import Capability, Evidence, SourceStatus
from ..core.topology import normalize_bdf
from . import telemetry as T
from .episodes import LinkEpisode, LinkJudge
from .records import C, AerRecord, LinkEventRecord
from .section import PcieSection
from .sysfs import PciePoller

log = logging.getLogger("mcp_hostagent")

KEEP_EVENTS = 256
REPOLL_MIN_NS = 100_000_000  # a burst of link events re-polls sysfs at most this often; the tick polls anyway


class Pcie(Capability):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.poller = PciePoller(ctx.sysfs_root)
        self.busy_util_pct = ctx.cfg.pcie_busy_util_pct
        self.judge = LinkJudge(busy_util_pct=self.busy_util_pct)
        # {GPU bdf: utilisation %} now; pid -> {GPU index: bdf} of its contexts
        self.util = ctx.inputs.get("gpu.util_by_bdf", lambda: {})
        self.gpus_of = ctx.inputs.get("gpu.gpus_of", lambda pid: {})
        self.sources: dict[str, SourceStatus] = {}
        self.last_pcie = None
        self.pcie_events: deque = deque(maxlen=KEEP_EVENTS)  # (name, t_ns, bdf, attributes) from tracepoints
        self.pcie_event_counts: Counter = Counter()  # (event, bdf) -> count
        self._polled_ns = 0
        self.links: T.LinkEpisodeSpans | None = None  # once the agent has telemetry
        self.episode_listeners: list = []  # called with each LinkEpisode (the top snapshot)

    def start(self) -> list[SourceStatus]:
        if self.ctx.telemetry is not None:
            self.links = T.LinkEpisodeSpans(self.ctx.telemetry)
        if not self.ctx.cfg.gpu_enabled:
            self.sources["pcie_sysfs"] = SourceStatus("pcie_sysfs", "disabled", "gpu.enabled = false")
        else:
            try:
                self.last_pcie = self.poller.poll()
                self.sources["pcie_sysfs"] = SourceStatus("pcie_sysfs", "attached")
            except OSError as e:
                self.sources["pcie_sysfs"] = SourceStatus("pcie_sysfs", "missing", f"read /sys/bus/pci: {e}")
        return list(self.sources.values())

    def section(self):
        sec = PcieSection(lambda: self.last_pcie, self.ctx.inputs.get("gpu.links", lambda: {}), self.busy_util_pct)
        self.episode_listeners.append(sec.on_link_episode)
        return sec

    def tick(self) -> list[LinkEpisode]:
        return self.poll_links()

    def poll_links(self) -> list[LinkEpisode]:
        """Poll the links and judge them against the GPUs' utilisation."""
        if self.sources.get("pcie_sysfs", SourceStatus("", "")).state != "attached":
            return []
        util = self.util()
        try:
            self.last_pcie = self.poller.poll()
            self._polled_ns = self.last_pcie.t_ns
            episodes = self.judge.update(self.last_pcie, util)
        except OSError as e:  # a device vanished mid-read: next poll sees it as gone
            log.debug("pcie poll: %s", e)
            return []
        return self._episodes(episodes)

    def _episodes(self, episodes: list[LinkEpisode]) -> list[LinkEpisode]:
        for ep in episodes:
            if self.links is not None:
                self.links.on_episode(ep)
            for listen in self.episode_listeners:
                listen(ep)
        return episodes

    # ---- tracepoint records (pcie.bpf.c's raw copies, decoded by the core) ----
    def raw(self, kind: int, rec, t_ns: int) -> None:
        if kind == C["MCP_TP_AER_EVENT"]:
            self.on_aer(rec, t_ns)
        else:
            self.on_link_event(rec, t_ns)

    def on_aer(self, ev: AerRecord, t_ns: int) -> list[LinkEpisode]:
        """An AER error: to the judge (counted at the next poll) and to the events on the GPU's path."""
        bdf = normalize_bdf(ev.dev)
        self.judge.note_aer_event(bdf, ev.severity, ev.errors)
        self.pcie_event_counts[("aer_event", bdf)] += 1
        self.pcie_events.append(("hostagent.pcie.aer_event", t_ns, bdf, {
            "hostagent.pcie.bdf": bdf, "hostagent.pcie.aer.kind": ev.severity, "hostagent.pcie.aer.errors": list(ev.errors)}))
        return []

    def on_link_event(self, ev: LinkEventRecord, t_ns: int) -> list[LinkEpisode]:
        """A link change: an event, and the links polled at once (at most every REPOLL_MIN_NS)."""
        bdf = normalize_bdf(ev.port)
        self.pcie_event_counts[("pcie_link_event", bdf)] += 1
        self.pcie_events.append(("hostagent.pcie.link_event", t_ns, bdf, ev.attributes()))
        if self.poller._clock() - self._polled_ns >= REPOLL_MIN_NS:
            return self.poll_links()
        return []

    # ---- a request's window ----
    def events_between(self, bdfs: set[str], t0_ns: int, t1_ns: int) -> list[tuple[str, int, dict]]:
        """Tracepoint events on the GPUs' paths (the GPU and the bridges above it) in the window."""
        paths = getattr(self.last_pcie, "paths", None) or {}
        on_path = {b for g in bdfs for b in (g, *paths.get(g, ()))}
        return [(name, t, attrs) for name, t, bdf, attrs in self.pcie_events if t0_ns <= t <= t1_ns and bdf in on_path]

    def evidence(self, fr) -> Evidence:
        """Links to the episodes of the request's GPUs that overlap it, and the path's events in it."""
        bdfs = set(self.gpus_of(fr.tgid).values())
        links = self.links.evidence(fr.begin_ns, fr.end_ns, bdfs) if self.links is not None else Evidence()
        return links + T.events(self.events_between(bdfs, fr.begin_ns, fr.end_ns))

    def instruments(self) -> list:
        return T.instruments(self, self.links)
