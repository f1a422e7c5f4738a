"""What capabilities hand to telemetry: plain data, no OpenTelemetry objects.

A capability maps its findings to SpanSpecs (a finished span, or a long one opened under a key and
closed later) and to metric rows for the Instruments it declares. telemetry/otel.py turns them into
SDK spans and observations; the top snapshot reads the same capabilities' plain state. Times are
kernel CLOCK_MONOTONIC ns (BPF timestamps); otel.py converts them to wall time, in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable


@dataclass(frozen=True)
class EventSpec:
    name: str
    t_ns: int
    attributes: dict = field(default_factory=dict)


@dataclass(frozen=True)
class LinkSpec:
    """A link to a span opened under `key` (Telemetry.open). `event`, if given, is added to the linking
    span too, with the linked span's ids under the attribute names in `id_attrs` (trace id, span id;
    None leaves one out): Tempo shows events where it does not show links."""

    key: Hashable
    attributes: dict
    event: EventSpec | None = None
    id_attrs: tuple[str | None, str | None] = (None, None)


@dataclass(frozen=True)
class SpanSpec:
    name: str
    start_ns: int
    end_ns: int | None  # None: a span opened now and closed later (Telemetry.open / close)
    attributes: dict
    parent: object | None = None  # core.traceparent.TraceParent: the application's span
    links: tuple[LinkSpec, ...] = ()
    events: tuple[EventSpec, ...] = ()
    children: tuple["SpanSpec", ...] = ()
    error: str | None = None  # the status message of an ERROR span
    # The observed process this span describes (process.*, container.*, k8s.pod.uid): exported as the
    # span's resource, as OpenTelemetry's conventions put process identity, so that a collector's
    # k8sattributes processor can enrich it. None: the agent's host resource.
    resource: dict | None = None


@dataclass(frozen=True)
class Instrument:
    """An instrument a capability declares once. Observable kinds ("counter", "gauge") report the rows
    last published under `name` (Telemetry.publish), or, with `read`, what read() returns at
    collection time (only for state that is safe to read from the SDK's reader thread). A
    "histogram" is recorded into (Telemetry.record) and exported with exponential buckets. A
    "log2_ns" histogram is one the kernel already bucketed: `read` returns [(Log2Buckets, attributes)],
    exported as a cumulative histogram in seconds with the kernel's own bucket bounds."""

    name: str
    kind: str  # "counter" | "gauge" | "histogram" | "log2_ns"
    unit: str = ""
    description: str = ""
    read: Callable[[], list] | None = None  # -> [(value, attributes)]


@dataclass(frozen=True)
class Log2Buckets:
    """Cumulative counts of a BPF log2 histogram: slot k holds values in [2**(k-1), 2**k - 1] ns
    (bcc's bpf_log2l(v) is floor(log2(v)) + 1, as its print_log2_hist reads it). No sum: the
    kernel does not keep one."""

    slots: dict  # slot -> count


Rows = dict  # instrument name -> [(value, attributes)]
