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
import time
import uuid
from collections import OrderedDict
from dataclasses import replace
from typing import Hashable, Iterable

from opentelemetry import trace
from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import Histogram as HistogramInstrument
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (AggregationTemporality, Histogram, HistogramDataPoint, Metric,
                                              MetricExporter, MetricExportResult, MetricsData, PeriodicExportingMetricReader,
                                              ResourceMetrics, ScopeMetrics)
from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from .. import __version__
from ..core.timebase import Timebase
from ..exporters import Exporters
from ..exporters.counting import CountingBatchSpanProcessor
from .spec import Instrument, Log2Buckets, Rows, SpanSpec

# The batch span processor exports what is queued once per schedule delay (sooner when 512 spans are
# queued), so a span waits for the next export: uniformly over one period plus an export, then the
# export. At 1000 ms the p99 from a request's end to its span at a loopback collector was 1.0-1.1 s
# (bench/bench_latency.py), over the 1 s target; 500 ms leaves half the budget to the export and the
# collector. A wake-up with nothing queued exports nothing; with spans flowing it is one more export
# call a second (~1-3 ms of CPU), and above ~1,000 spans/s the 512-span trigger decides anyway.
SPAN_SCHEDULE_DELAY_MS = 500.0
# Per-process instruments: their SDK state is dropped with the process (forget_processes).
PROCESS_PREFIXES = ("hostagent.process.", "process.", "hostagent.gpu.process.")
SCOPE = "mcp_hostagent"
# BPF log2 histograms are exported with the bounds of slots LOG2_SLOTS (2**k - 1 ns upper bounds):
# 255 ns .. 17.2 s covers a uprobe'd driver call on bare metal up to a reclaim stall that froze a
# server; slots below fold into the first bucket, above into +Inf. Fixed bounds: a Prometheus series
# per `le` that does not come and go with the data.
LOG2_SLOTS = range(8, 35)
LOG2_BOUNDS = [((1 << k) - 1) / 1e9 for k in LOG2_SLOTS]  # seconds; slot k holds [2^(k-1), 2^k - 1] ns
MAX_PROCESS_RESOURCES = 1024  # tracer providers kept, one per observed process (LRU)
# Exponential histograms (OTel's own, base-2 at a scale the SDK adapts): no bounds picked in advance
# for requests of 1 ms or 10 minutes. 160 buckets hold 10 ms..60 s at scale 3 (buckets 9% wide).
EXPONENTIAL = ExponentialBucketHistogramAggregation(max_size=160)


def span_schedule_delay_ms(env=None) -> float:
    """OTEL_BSP_SCHEDULE_DELAY (ms, the SDK's own variable) when set to a positive number, else ours."""
    raw = (os.environ if env is None else env).get("OTEL_BSP_SCHEDULE_DELAY", "")
    try:
        value = float(raw)
    except ValueError:
        return SPAN_SCHEDULE_DELAY_MS
    return value if value > 0 else SPAN_SCHEDULE_DELAY_MS


def instance_id(service_name: str, env=None, machine_id_path: str = "/etc/machine-id") -> str:
    """service.instance.id: OTEL_RESOURCE_ATTRIBUTES' own when it sets one, else a UUIDv5 of the
    machine id (the hostname where there is none) and the service name: the same across restarts,
    so a restart does not start new series in Prometheus/Mimir."""
    env = os.environ if env is None else env
    for item in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        k, _, v = item.partition("=")
        if k.strip() == "service.instance.id" and v.strip():
            return v.strip()
    try:
        with open(machine_id_path) as f:
            machine = f.read().strip()
    except OSError:
        machine = ""
    return str(uuid.uuid5(uuid.NAMESPACE_OID, f"{machine or socket.gethostname()}/{service_name}"))


def log2_histogram_point(b: Log2Buckets, attrs: dict, start_ns: int, now_ns: int) -> HistogramDataPoint:
    counts = [0] * (len(LOG2_BOUNDS) + 1)
    lo, hi = LOG2_SLOTS[0], LOG2_SLOTS[-1]
    for slot, n in b.slots.items():
        counts[0 if slot <= lo else len(LOG2_BOUNDS) if slot > hi else slot - lo] += n
    return HistogramDataPoint(attributes=attrs, start_time_unix_nano=start_ns, time_unix_nano=now_ns,
                              count=sum(counts), sum=None, bucket_counts=counts, explicit_bounds=LOG2_BOUNDS,
                              min=None, max=None)


class WithKernelHistograms(MetricExporter):
    """Adds the kernel-bucketed histograms (Instrument kind "log2_ns") to each export: the SDK has no
    instrument that takes buckets counted elsewhere, so they join its data here, as its own would."""

    def __init__(self, inner: MetricExporter, extra):
        super().__init__(preferred_temporality=getattr(inner, "_preferred_temporality", None),
                         preferred_aggregation=getattr(inner, "_preferred_aggregation", None))
        self.inner, self.extra = inner, extra

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        return self.inner.export(merge_metrics(metrics_data, self.extra()), timeout_millis=timeout_millis, **kwargs)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self.inner.force_flush(timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        self.inner.shutdown(timeout_millis=timeout_millis, **kwargs)

    def __getattr__(self, name):  # stats and the like of the wrapped exporter
        return getattr(self.inner, name)


def merge_metrics(data: MetricsData, extra: list) -> MetricsData:
    """`extra` Metrics into the agent's scope of `data`'s first resource (all of ours share one)."""
    if not extra or not data.resource_metrics:
        return data
    first = data.resource_metrics[0]
    scopes = list(first.scope_metrics)
    for i, sm in enumerate(scopes):
        if sm.scope.name == SCOPE:
            scopes[i] = ScopeMetrics(sm.scope, list(sm.metrics) + extra, sm.schema_url)
            break
    else:
        scopes.append(ScopeMetrics(InstrumentationScope(SCOPE, __version__), extra, ""))
    return MetricsData([ResourceMetrics(first.resource, scopes, first.schema_url), *data.resource_metrics[1:]])


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
        self._log2: list[Instrument] = []
        self._start_wall_ns = time.time_ns()
        self.exporters = exporters
        self.resource = resource = Resource.create({
            "service.name": service_name,
            "service.version": __version__,
            "service.instance.id": instance_id(service_name),
            "host.name": socket.gethostname(),
            "os.type": "linux",
        })
        self._processor = CountingBatchSpanProcessor(
            exporters.span_exporter, self.stats, max_queue_size=max_queue_size,
            schedule_delay_ms=span_schedule_delay_ms() if schedule_delay_ms is None else schedule_delay_ms)
        self.tracer_provider = TracerProvider(resource=resource, sampler=ALWAYS_ON)
        self.tracer_provider.add_span_processor(self._processor)
        self.tracer = self.tracer_provider.get_tracer(SCOPE, __version__)
        # One tracer provider per observed process, all feeding the one batch processor (its queue,
        # thread and counts): the SDK sets a span's resource from its provider.
        self._process_tracers: OrderedDict[frozenset, object] = OrderedDict()
        self.readers = [PeriodicExportingMetricReader(WithKernelHistograms(m, self.kernel_histograms),
                                                      export_interval_millis=metric_interval_s * 1000)
                        for m in exporters.metric_exporters]
        for r in exporters.pull_readers:  # the Prometheus endpoint: collected when scraped
            r.extra = self.kernel_histograms
            self.readers.append(r)
        self.meter_provider = MeterProvider(resource=resource, metric_readers=self.readers, views=[
            View(instrument_type=HistogramInstrument, aggregation=EXPONENTIAL)])
        self._meter = self.meter_provider.get_meter(SCOPE, __version__)

    # ---- spans ----
    def span(self, spec: SpanSpec, context=None):
        """A finished span, its events, links and child spans; its SpanContext (for later links to it)."""
        span = self._start(spec, context)
        span.end(end_time=self.timebase.to_wall_ns(max(spec.end_ns, spec.start_ns)))
        return span.get_span_context()

    def _start(self, spec: SpanSpec, context=None):
        wall = self.timebase.to_wall_ns
        if spec.parent is not None:
            p = spec.parent
            parent = SpanContext(p.trace_id, p.span_id, is_remote=True, trace_flags=TraceFlags(p.flags & 0x01))
            context = trace.set_span_in_context(NonRecordingSpan(parent))
        links = [(ln, self._contexts[ln.key]) for ln in spec.links if ln.key in self._contexts]
        tracer = self.tracer if not spec.resource else self._tracer_for(spec.resource)
        span = tracer.start_span(spec.name, context=context, kind=SpanKind.INTERNAL,
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
                # a child (a request's stall) is on a thread of the same process: the same resource
                self.span(child if child.resource or not spec.resource else replace(child, resource=spec.resource),
                          inner)
        if spec.error is not None:
            span.set_status(Status(StatusCode.ERROR, spec.error))
        return span

    def _tracer_for(self, attrs: dict):
        key = frozenset(clean(attrs).items())
        tracer = self._process_tracers.get(key)
        if tracer is not None:
            self._process_tracers.move_to_end(key)
            return tracer
        # shutdown_on_exit=False: the SDK's atexit hook would hold every provider (~3 KB each) for the
        # life of the agent, past the LRU's eviction, and shut the shared processor once per provider.
        provider = TracerProvider(resource=self.resource.merge(Resource(dict(key))), sampler=ALWAYS_ON,
                                  shutdown_on_exit=False)
        provider.add_span_processor(self._processor)
        tracer = self._process_tracers[key] = provider.get_tracer(SCOPE, __version__)
        if len(self._process_tracers) > MAX_PROCESS_RESOURCES:
            # Dropped, not shut down: shutting a provider down would shut the shared processor.
            self._process_tracers.popitem(last=False)
        return tracer

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

    def add_link(self, key: Hashable, context, attrs: dict) -> bool:
        """A link from the span still open under key to a finished span (its SpanContext); False when
        that span is closed. The SDK keeps the first OTEL_SPAN_LINK_COUNT_LIMIT (128) links of a span."""
        span = self._open.get(key)
        if span is None or context is None:
            return False
        span.add_link(context, clean(attrs))
        return True

    def forget(self, key: Hashable) -> None:
        self._contexts.pop(key, None)

    # ---- metrics ----
    def declare(self, instruments: Iterable[Instrument]) -> None:
        for inst in instruments:
            if inst.kind == "histogram":
                self._histograms[inst.name] = self._meter.create_histogram(
                    inst.name, unit=inst.unit, description=inst.description)
                continue
            if inst.kind == "log2_ns":
                self._log2.append(inst)
                continue
            create = {"counter": self._meter.create_observable_counter,
                      "gauge": self._meter.create_observable_gauge}[inst.kind]
            create(inst.name, [self._callback(inst)], unit=inst.unit, description=inst.description)

    def _rows_of(self, inst: Instrument):
        """An instrument's rows now: read() at collection time, else the last published ones."""
        if inst.read is not None:
            return inst.read()
        with self._lock:
            return self._rows.get(inst.name, ())

    def _callback(self, inst: Instrument):
        def cb(options):
            return [Observation(v, a) for v, a in self._rows_of(inst) if v is not None]
        return cb

    def kernel_histograms(self) -> list:
        """The "log2_ns" instruments as SDK Metrics, cumulative, in seconds (read by the exporters)."""
        now, out = time.time_ns(), []
        for inst in self._log2:
            try:
                rows = self._rows_of(inst)
            except Exception:  # noqa: BLE001 - a failing read loses this histogram, not the export
                continue
            points = [log2_histogram_point(b, clean(a), self._start_wall_ns, now) for b, a in rows]
            if points:
                out.append(Metric(inst.name, inst.description, "s",
                                  Histogram(points, AggregationTemporality.CUMULATIVE)))
        return out

    def publish(self, rows: Rows) -> None:
        """The latest rows of observable instruments, by name (replacing those names' earlier rows)."""
        with self._lock:
            self._rows.update(rows)

    def record(self, name: str, value: float, attrs: dict) -> None:
        self._histograms[name].record(value, attrs)

    def forget_processes(self, pids: set[int]) -> None:
        """Drop the SDK's state (instruments named PROCESS_PREFIXES) for processes no longer reported. The SDK keeps every attribute set an
        asynchronous instrument ever observed: memory grew with every process the host ever ran, and
        from the 2,000th set (its default cardinality limit) each instrument merged new processes into
        one `otel.metric.overflow` point (~3 minutes of `--watch all` on a host starting 10 processes a
        second). SDK internals, read with getattr: an SDK that renames them forgets nothing, as before."""
        consumer = getattr(self.meter_provider, "_measurement_consumer", None)
        for storage in list(getattr(consumer, "_reader_storages", {}).values()):
            for inst, matches in list(getattr(storage, "_instrument_view_instrument_matches", {}).items()):
                if not str(getattr(inst, "name", "")).startswith(PROCESS_PREFIXES):
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
        # The Prometheus endpoint's port first: a flush stuck on a collector must not keep it bound
        # past Agent.stop's wait, or the SIGHUP reload that follows cannot bind it again.
        self.exporters.close()
        self.flush(timeout_s)
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown(timeout_millis=timeout_s * 1000)
