"""PCIe -> telemetry: link episodes as spans that request spans on the same GPU link to, and the
sysfs link, AER and tracepoint metrics."""

from __future__ import annotations

from ..core.capability import Evidence
from ..telemetry.spec import EventSpec, Instrument, LinkSpec, SpanSpec

LINK_SPAN = "hostagent.pcie.link_episode"
KEEP_CLOSED = 32  # closed episodes kept for request spans that end later and overlap them


class LinkEpisodeSpans:
    """pcie LinkEpisode events -> one span per episode: opened -> span started at the episode's start;
    updated -> span event; closed -> span ended."""

    def __init__(self, telemetry):
        self.telemetry = telemetry
        self.episodes: dict[int, list] = {}  # episode id -> [gpu_bdf, start_ns, end_ns or None]

    def on_episode(self, ep) -> None:
        key = ("pcie", ep.episode_id)
        ref = self.episodes.get(ep.episode_id)
        if ep.event == "opened" or ref is None:
            self.telemetry.open(key, SpanSpec(LINK_SPAN, ep.start_ns, None, ep.attributes()))
            ref = self.episodes[ep.episode_id] = [ep.gpu_bdf, ep.start_ns, None]
        if ep.event == "updated":
            self.telemetry.event(key, "hostagent.pcie.link_update", ep.t_ns, ep.attributes())
        elif ep.event == "closed":
            ref[2] = ep.end_ns or ep.t_ns
            self.telemetry.close(key, ep.attributes(), ref[2])
            # the oldest by their end: a long episode that just closed is the one a request may still overlap
            closed = sorted((k for k, r in self.episodes.items() if r[2] is not None), key=lambda k: self.episodes[k][2])
            for k in closed[:-KEEP_CLOSED]:
                del self.episodes[k]
                self.telemetry.forget(("pcie", k))

    def active(self) -> int:
        return sum(1 for r in list(self.episodes.values()) if r[2] is None)  # (read from the SDK's thread)

    def evidence(self, t0: int, t1: int, gpu_bdfs: set[str]) -> Evidence:
        return Evidence(links=tuple(
            LinkSpec(("pcie", k), {"hostagent.link.type": "pcie_link_episode", "hostagent.pcie.gpu_bdf": bdf},
                     EventSpec("hostagent.pcie.link_episode", max(t0, start), {"hostagent.pcie.gpu_bdf": bdf}),
                     (None, "hostagent.pcie.span_id"))
            for k, (bdf, start, end) in self.episodes.items()
            if bdf in gpu_bdfs and start < t1 and (end is None or end > t0)))


def events(found: list[tuple[str, int, dict]]) -> Evidence:
    return Evidence(events=tuple(EventSpec(name, t, attrs) for name, t, attrs in found))


def instruments(pcie, spans: LinkEpisodeSpans | None) -> list[Instrument]:
    """pcie: the Pcie capability, read at collection time (its sysfs snapshot is replaced whole)."""
    def links():
        out = []
        for bdf, st in (getattr(pcie.last_pcie, "links", None) or {}).items():
            base = {"hostagent.pcie.bdf": bdf, "hostagent.pcie.role": getattr(st, "role", "")}
            for field_, v in (("gen", st.gen), ("gen_max", st.max_gen), ("width", st.width), ("width_max", st.max_width)):
                if v is not None:
                    out.append((v, {**base, "hostagent.pcie.field": field_}))
        return out

    def aer():
        return [(st.aer.total(kind), {"hostagent.pcie.bdf": bdf, "hostagent.pcie.aer.kind": kind})
                for bdf, st in (getattr(pcie.last_pcie, "links", None) or {}).items() if st.aer is not None
                for kind in ("correctable", "nonfatal", "fatal")]

    return [
        Instrument("hostagent.pcie.link", "gauge", "", "sysfs link state of GPUs and their bridges", links),
        Instrument("hostagent.pcie.aer.errors", "counter", "{error}", "AER error counts from sysfs", aer),
        Instrument("hostagent.pcie.tracepoint.events", "counter", "{event}",
                   "ras:aer_event and pci:pcie_link_event records, by device (BPF)",
                   lambda: [(n, {"hostagent.pcie.event": ev, "hostagent.pcie.bdf": bdf})
                            for (ev, bdf), n in dict(pcie.pcie_event_counts).items()]),
        Instrument("hostagent.pcie.link_episode.active", "gauge", "", "degraded PCIe link episodes open now",
                   read=lambda: [(spans.active(), {})] if spans is not None else []),
    ]
