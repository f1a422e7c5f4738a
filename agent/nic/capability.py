"""NIC: link events of the host's interfaces from rtnetlink (netlink.py) -> span events on the
requests in flight, counts by interface and kind, and the links the top snapshot shows. No BPF."""

from __future__ import annotations

import logging
from collections import Counter, deque

from ..core.capability import Capability, Evidence, SourceStatus
from ..telemetry.spec import EventSpec
from . import telemetry as T
from .netlink import NicWatcher
from .section import NicSection

log = logging.getLogger("mcp_hostagent")

KEEP_EVENTS = 256


class Nic(Capability):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.nics = NicWatcher(sysfs_root=ctx.sysfs_root) if ctx.cfg.nic_enabled else None
        self.sources: dict[str, SourceStatus] = {}
        self.nic_events: deque = deque(maxlen=KEEP_EVENTS)  # drained LinkEvents, newest last
        self.nic_counts: Counter = Counter()  # (ifname, kind) -> count

    def start(self) -> list[SourceStatus]:
        if self.nics is None:
            self.sources["nic_netlink"] = SourceStatus("nic_netlink", "disabled", "nic.enabled = false")
        else:
            ok = self.nics.start()
            self.sources["nic_netlink"] = SourceStatus("nic_netlink", "attached" if ok else "missing",
                                                       "" if ok else (getattr(self.nics, "reason", None) or "netlink unavailable"))
        return list(self.sources.values())

    def section(self):
        return NicSection(self)

    def tick(self) -> None:
        """Drain the watcher's events (its own thread reads netlink)."""
        if self.nics is not None and self.sources["nic_netlink"].state == "attached":
            for ev in self.nics.drain():
                self.nic_events.append(ev)
                self.nic_counts[(ev.ifname, ev.kind)] += 1

    def evidence(self, fr) -> Evidence:
        """Every link event in the request's window: a flap anywhere on the host may be what it waited on."""
        return Evidence(events=tuple(EventSpec("hostagent.nic.link_event", e.t_ns, e.attributes())
                                     for e in self.nic_events if fr.begin_ns <= e.t_ns <= fr.end_ns))

    def instruments(self) -> list:
        return T.instruments(self)

    def stop(self) -> None:
        if self.nics is not None:
            try:
                self.nics.stop()
            except Exception as e:  # stopping must finish for the others
                log.debug("stop %s: %s", type(self.nics).__name__, e)
