"""Plain data from the capabilities -> OpenTelemetry spans and metrics, through the SDK.

Capabilities never touch the SDK: they hand SpanSpecs and metric rows (telemetry/spec.py). This
module owns the providers, the batch span processor (its own thread: the ring-buffer reader never
waits on an exporter), the one kernel-monotonic -> wall conversion of span times, and the spans
opened under a key (reclaim storms, PCIe link episodes) that later spans link to.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Hashable, Iterable

from opentelemetry import trace
from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from .. import __version__
from ..core.timebase import Timebase
from ..exporters import Exporters
from ..exporters.counting import CountingBatchSpanProcessor
from .spec import Instrument, Rows, SpanSpec

# The batch span processor exports what is queued once per schedule delay (sooner when 512 spans are
# queued), so a span waits for the next export: uniformly over one period plus an export, then the
# export. At 1000 ms the p99 from a request's end to its span at a loopback collector was 1.0-1.1 s
# (bench/bench_latency.py), over the 1 s target; 500 ms leaves half the budget to the export and the
# collector. A wake-up with nothing queued exports nothing; with spans flowing it is one more export
# call a second (~1-3 ms of CPU), and above ~1,000 spans/s the 512-span trigger decides anyway.
SPAN_SCHEDULE_DELAY_MS = 500.0
PROCESS_PREFIX = "mcp.process."  # per-process instruments: their SDK state is dropped with the process


def span_schedule_delay_ms(env=None) -> float:
    """OTEL_BSP_SCHEDULE_DELAY (ms, the SDK's own variable) when set to a positive number, else ours."""
    raw = (os.environ if env is None else env).get("OTEL_BSP_SCHEDULE_DELAY", "")
    try:
        value = float(raw)
    except ValueError:
        return SPAN_SCHEDULE_DELAY_MS
    return value if value > 0 else SPAN_SCHEDULE_DELAY_MS


def clean(attrs: dict) -> dict:
    """OTel attributes cannot be None: unknown values are left out."""
    return {k: v for k, v in attrs.items() if v is not None}


class Telemetry:
    def __init__(self, *, service_name: str, exporters: Exporters, timebase: Timebase,
                 max_queue_size: int = 8192, metric_interval_s: float = 10.0, schedule_delay_ms: float | None = None):
        self.timebase = timebase
        self.stats = exporters.stats
        self._lock = threading.Lock()
        self._rows: Rows = {}
        self._open: dict[Hashable, object] = {}  # key -> SDK span, open
        self._contexts: dict[Hashable, SpanContext] = {}  # key -> context, open or closed until forget()
        self._histograms: dict[str, object] = {}
        resource = Resource.create({
            "service.name": service_name,
            "service.version": __version__,
            "host.name": socket.gethostname(),
            "os.type": "linux",
        })
        self.tracer_provider = TracerProvider(resource=resource, sampler=ALWAYS_ON)
        self.tracer_provider.add_span_processor(CountingBatchSpanProcessor(
            exporters.span_exporter, self.stats, max_queue_size=max_queue_size,
            schedule_delay_ms=span_schedule_delay_ms() if schedule_delay_ms is None else schedule_delay_ms))
        self.tracer = self.tracer_provider.get_tracer("mcp_hostagent", __version__)
        self.readers = [PeriodicExportingMetricReader(m, export_interval_millis=metric_interval_s * 1000)
                        for m in exporters.metric_exporters]
        self.meter_provider = MeterProvider(resource=resource, metric_readers=self.readers)
        self._meter = self.meter_provider.get_meter("mcp_hostagent", __version__)

    # ---- spans ----
    def span(self, spec: SpanSpec, context=None) -> None:
        """A finished span, its events, links and child spans."""
        self._start(spec, context).end(end_time=self.timebase.to_wall_ns(max(spec.end_ns, spec.start_ns)))

    def _start(self, spec: SpanSpec, context=None):
        wall = self.timebase.to_wall_ns
        if spec.parent is not None:
            p = spec.parent
            parent = SpanContext(p.trace_id, p.span_id, is_remote=True, trace_flags=TraceFlags(p.flags & 0x01))
            context = trace.set_span_in_context(NonRecordingSpan(parent))
        links = [(ln, self._contexts[ln.key]) for ln in spec.links if ln.key in self._contexts]
        span = self.tracer.start_span(spec.name, context=context, kind=SpanKind.INTERNAL,
                                      start_time=wall(spec.start_ns), attributes=clean(spec.attributes),
                                      links=[Link(ctx, ln.attributes) for ln, ctx in links])
        for ln, ctx in links:
            if ln.event is not None:
                ids = {}
                if ln.id_attrs[0]:
                    ids[ln.id_attrs[0]] = f"{ctx.trace_id:032x}"
                if ln.id_attrs[1]:
                    ids[ln.id_attrs[1]] = f"{ctx.span_id:016x}"
                span.add_event(ln.event.name, {**ln.event.attributes, **ids}, timestamp=wall(ln.event.t_ns))
        for ev in spec.events:
            span.add_event(ev.name, clean(ev.attributes), timestamp=wall(ev.t_ns))
        if spec.children:
            inner = trace.set_span_in_context(span)
            for child in spec.children:
                self.span(child, inner)
        if spec.error is not None:
            span.set_status(Status(StatusCode.ERROR, spec.error))
        return span

    def open(self, key: Hashable, spec: SpanSpec) -> None:
        """A span that stays open (an episode) until close(key); later spans may link to it."""
        span = self._start(spec)
        self._open[key] = span
        self._contexts[key] = span.get_span_context()

    def event(self, key: Hashable, name: str, t_ns: int, attrs: dict) -> None:
        span = self._open.get(key)
        if span is not None:
            span.add_event(name, clean(attrs), timestamp=self.timebase.to_wall_ns(t_ns))

    def close(self, key: Hashable, attrs: dict, end_ns: int | None) -> None:
        """End the span opened under key (at end_ns; None: now). Its context stays until forget()."""
        span = self._open.pop(key, None)
        if span is not None:
            span.set_attributes(clean(attrs))
            span.end(end_time=None if end_ns is None else self.timebase.to_wall_ns(end_ns))

    def forget(self, key: Hashable) -> None:
        self._contexts.pop(key, None)

    # ---- metrics ----
    def declare(self, instruments: Iterable[Instrument]) -> None:
        for inst in instruments:
            if inst.kind == "histogram":
                self._histograms[inst.name] = self._meter.create_histogram(
                    inst.name, unit=inst.unit, description=inst.description)
                continue
            create = {"counter": self._meter.create_observable_counter,
                      "gauge": self._meter.create_observable_gauge}[inst.kind]
            create(inst.name, [self._callback(inst)], unit=inst.unit, description=inst.description)

    def _callback(self, inst: Instrument):
        def cb(options):
            if inst.read is not None:
                rows = inst.read()
            else:
                with self._lock:
                    rows = self._rows.get(inst.name, ())
            return [Observation(v, a) for v, a in rows if v is not None]
        return cb

    def publish(self, rows: Rows) -> None:
        """The latest rows of observable instruments, by name (replacing those names' earlier rows)."""
        with self._lock:
            self._rows.update(rows)

    def record(self, name: str, value: float, attrs: dict) -> None:
        self._histograms[name].record(value, attrs)

    def forget_processes(self, pids: set[int]) -> None:
        """Drop the SDK's state (instruments named mcp.process.*) for processes no longer reported. The SDK keeps every attribute set an
        asynchronous instrument ever observed: memory grew with every process the host ever ran, and
        from the 2,000th set (its default cardinality limit) each instrument merged new processes into
        one `otel.metric.overflow` point (~3 minutes of `--watch all` on a host starting 10 processes a
        second). SDK internals, read with getattr: an SDK that renames them forgets nothing, as before."""
        consumer = getattr(self.meter_provider, "_measurement_consumer", None)
        for storage in list(getattr(consumer, "_reader_storages", {}).values()):
            for inst, matches in list(getattr(storage, "_instrument_view_instrument_matches", {}).items()):
                if not str(getattr(inst, "name", "")).startswith(PROCESS_PREFIX):
                    continue
                for match in matches:
                    aggs, lock = getattr(match, "_attributes_aggregation", None), getattr(match, "_lock", None)
                    if not isinstance(aggs, dict) or lock is None:
                        continue
                    with lock:
                        for key in [k for k, a in aggs.items()
                                    if (getattr(a, "_attributes", None) or {}).get("process.pid") in pids]:
                            del aggs[key]

    def flush(self, timeout_s: float = 3.0) -> None:
        self.tracer_provider.force_flush(int(timeout_s * 1000))
        self.meter_provider.force_flush(int(timeout_s * 1000))

    def shutdown(self, timeout_s: float = 3.0) -> None:
        self.flush(timeout_s)
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown(timeout_millis=timeout_s * 1000)
