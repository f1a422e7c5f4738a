"""Finished requests and counter snapshots -> OpenTelemetry spans and metrics.

The pipeline hands this module plain data (FinishedRequest, per-process Counters, AgentHealth); it
never reads BPF maps or /proc. Spans go through the SDK's batch processor (its own thread), so the
ring-buffer reader never waits on an exporter. Attribute names: OTel semantic conventions where
they exist, `mcp.*` for ours (docs/TELEMETRY.md).
"""

from __future__ import annotations

import socket
import threading
from collections import Counter
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from . import __version__
from .decode import Counters
from .join import FinishedRequest
from .timebase import Timebase
from mcp_hostagent.exporters import Exporters
from mcp_hostagent.exporters.counting import CountingBatchSpanProcessor

SPAN_NAME = "mcp.request"


@dataclass
class AgentHealth:
    """The agent's own state, exported as mcp.agent.* metrics and summarised at exit."""

    probes: dict[str, str] = field(default_factory=dict)  # probe -> attached|missing|disabled
    compile_s: float = 0.0
    kernel_stats: dict[str, int] = field(default_factory=dict)  # enum mcp_stat label -> total
    rejected: Counter = field(default_factory=Counter)  # user-space reasons
    user_lost: int = 0  # records we failed to handle
    requests: Counter = field(default_factory=Counter)  # end_reason -> count

    def kernel_lost(self) -> int:
        return self.kernel_stats.get("rb_lost", 0)


def request_attributes(fr: FinishedRequest, proc_attrs: dict) -> dict:
    c = fr.counters
    attrs = dict(proc_attrs)
    attrs.update({
        "process.pid": fr.tgid,
        "thread.id": fr.tid,
        "mcp.request.id": f"{fr.request_id:016x}",
        "mcp.request.end_reason": fr.end_reason,
        "mcp.request.traceparent": fr.traceparent_state,
        "mcp.cgroup.id": fr.cgroup_id,
        "mcp.faults.user": c.faults,
        "mcp.ctx_switches.voluntary": c.vcsw,
        "mcp.ctx_switches.involuntary": c.ivcsw,
        "mcp.offcpu_ns": c.offcpu_ns,
    })
    return attrs


class Telemetry:
    def __init__(self, *, service_name: str, exporters: Exporters, timebase: Timebase, health: AgentHealth,
                 max_queue_size: int = 8192, metric_interval_s: float = 10.0, schedule_delay_ms: float = 1000):
        self.timebase = timebase
        self.health = health
        self.stats = exporters.stats
        self._lock = threading.Lock()
        self._proc_rows: dict[int, tuple[dict, Counters]] = {}
        resource = Resource.create({
            "service.name": service_name,
            "service.version": __version__,
            "host.name": socket.gethostname(),
            "os.type": "linux",
        })
        self.tracer_provider = TracerProvider(resource=resource, sampler=ALWAYS_ON)
        self.tracer_provider.add_span_processor(CountingBatchSpanProcessor(
            exporters.span_exporter, self.stats, max_queue_size=max_queue_size, schedule_delay_ms=schedule_delay_ms))
        self.tracer = self.tracer_provider.get_tracer("mcp_hostagent", __version__)
        self.readers = [PeriodicExportingMetricReader(m, export_interval_millis=metric_interval_s * 1000)
                        for m in exporters.metric_exporters]
        self.meter_provider = MeterProvider(resource=resource, metric_readers=self.readers)
        self._instruments()

    # ---- spans ----
    def emit_request(self, fr: FinishedRequest, proc_attrs: dict) -> None:
        ctx = None
        if fr.parent is not None:
            parent = SpanContext(fr.parent.trace_id, fr.parent.span_id, is_remote=True,
                                 trace_flags=TraceFlags(fr.parent.flags & 0x01))
            ctx = trace.set_span_in_context(NonRecordingSpan(parent))
        span = self.tracer.start_span(SPAN_NAME, context=ctx, kind=SpanKind.INTERNAL,
                                      start_time=self.timebase.to_wall_ns(fr.begin_ns),
                                      attributes=request_attributes(fr, proc_attrs))
        if fr.is_error:
            span.set_status(Status(StatusCode.ERROR, f"request ended: {fr.end_reason}"))
        span.end(end_time=self.timebase.to_wall_ns(max(fr.end_ns, fr.begin_ns)))
        self._duration.record((fr.end_ns - fr.begin_ns) / 1e6, {
            "process.executable.name": proc_attrs.get("process.executable.name", ""),
            "mcp.request.end_reason": fr.end_reason})
        with self._lock:
            self.health.requests[fr.end_reason] += 1

    # ---- metrics ----
    def set_process_counters(self, rows: dict[int, tuple[dict, Counters]]) -> None:
        """rows: pid -> (identity attributes, cumulative counters since the agent saw the process)."""
        with self._lock:
            self._proc_rows = dict(rows)

    def _proc_obs(self, pick):
        def cb(options: CallbackOptions):
            with self._lock:
                rows = list(self._proc_rows.values())
            return [Observation(v, {**a, **extra}) for a, c in rows for v, extra in pick(c)]
        return cb

    def _instruments(self) -> None:
        m = self.meter_provider.get_meter("mcp_hostagent", __version__)
        m.create_observable_counter("mcp.process.page_faults", [self._proc_obs(lambda c: [(c.faults, {})])],
                                    unit="{fault}", description="user page faults (exceptions:page_fault_user)")
        m.create_observable_counter(
            "mcp.process.context_switches",
            [self._proc_obs(lambda c: [(c.vcsw, {"mcp.switch.type": "voluntary"}),
                                       (c.ivcsw, {"mcp.switch.type": "involuntary"})])],
            unit="{switch}", description="context switches (sched:sched_switch)")
        m.create_observable_counter("mcp.process.offcpu_ns", [self._proc_obs(lambda c: [(c.offcpu_ns, {})])],
                                    unit="ns", description="time the process's threads spent switched out")
        self._duration = m.create_histogram("mcp.request.duration_ms", unit="ms",
                                            description="marked request duration")
        h = self.health

        def obs(fn):
            return [lambda options: [Observation(v, a) for v, a in fn()]]

        m.create_observable_gauge("mcp.agent.probes", obs(lambda: [
            (1, {"mcp.probe": name, "mcp.probe.state": state}) for name, state in h.probes.items()]),
            description="1 per probe, by state (attached, missing, disabled)")
        m.create_observable_gauge("mcp.agent.bpf.compile_s", obs(lambda: [(h.compile_s, {})]), unit="s",
                                  description="BPF compile time at start-up")
        m.create_observable_counter("mcp.agent.events.lost", obs(lambda: [
            (h.kernel_lost(), {"mcp.where": "kernel"}), (h.user_lost, {"mcp.where": "user"})]),
            description="records lost: ring buffer full (kernel) or failed to handle (user)")
        m.create_observable_counter("mcp.agent.records.rejected", obs(lambda: [
            (v, {"mcp.reason": k}) for k, v in self._rejected().items()]),
            description="markers and records rejected, by reason")
        m.create_observable_counter("mcp.agent.spans.exported", obs(lambda: [
            (self.stats.snapshot().get("spans_exported", 0), {})]), description="spans the exporters accepted")
        m.create_observable_counter("mcp.agent.spans.dropped", obs(lambda: [
            (self.stats.snapshot().get("spans_dropped_queue", 0), {"mcp.reason": "queue_full"}),
            (self.stats.snapshot().get("spans_failed", 0), {"mcp.reason": "export_failed"})]),
            description="spans not delivered")

    def _rejected(self) -> dict[str, int]:
        out = {k: v for k, v in self.health.kernel_stats.items() if k != "rb_lost"}
        for k, v in self.health.rejected.items():
            out[k] = out.get(k, 0) + v
        return out

    def flush(self, timeout_s: float = 3.0) -> None:
        self.tracer_provider.force_flush(int(timeout_s * 1000))
        self.meter_provider.force_flush(int(timeout_s * 1000))

    def shutdown(self, timeout_s: float = 3.0) -> None:
        self.flush(timeout_s)
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown(timeout_millis=timeout_s * 1000)
