"""What a capability plugs into the core with (requests, reclaim, cuda, gpuhealth, pcie, nic, numa;
docs/ARCHITECTURE.md).

A capability is an object with any of these; the core calls only what it has:

    routes() -> {record type: Route}     its ring-buffer records: struct, builder, handlers
    handlers() -> {record type: handler} records of another capability it consumes (requests: stalls)
    start() -> [SourceStatus]            its sources outside BPF (NVML, sysfs, netlink), each with a state
    instruments() -> [Instrument]        metrics it declares once (telemetry/spec.py)
    tick()                               periodic work on the agent's thread, one counted step each
    evidence(request) -> Evidence        what it saw of one finished request's window
    stop()

Capabilities hand telemetry plain data (SpanSpec, metric rows) and keep the plain state the top
snapshot reads. What one needs of another is handed to it at construction by the core (a function,
a listener), so the wiring is in one place: core/agent.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..telemetry.spec import EventSpec, LinkSpec


@dataclass(frozen=True)
class Evidence:
    attributes: dict = field(default_factory=dict)
    links: tuple[LinkSpec, ...] = ()
    events: tuple[EventSpec, ...] = ()

    def __add__(self, other: "Evidence") -> "Evidence":
        return Evidence({**self.attributes, **other.attributes}, self.links + other.links,
                        self.events + other.events)


NONE = Evidence()


@dataclass(frozen=True)
class SourceStatus:
    """A source outside BPF (NVML, sysfs, netlink): attached, missing or disabled, and why."""

    name: str
    state: str  # attached | missing | disabled
    reason: str = ""
