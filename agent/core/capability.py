"""What a capability plugs into the core with (requests, reclaim, cuda, gpuhealth; docs/ARCHITECTURE.md).

A capability is an object with any of these; the core calls only what it has:

    routes() -> {record type: Route}     its ring-buffer records: struct, builder, handlers
    instruments() -> [Instrument]        metrics it declares once (telemetry/spec.py)
    tick() -> None                       periodic work on the agent's thread, after the map read
    evidence(request) -> Evidence        what it saw of one finished request's window
    stop() -> None

Capabilities hand telemetry plain data (SpanSpec, metric rows) and keep the plain state the top
snapshot reads; none of them reaches into another or into the core's loop.
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
