"""Finished requests and counter snapshots -> OpenTelemetry spans and metrics.

The pipeline hands this module plain data (FinishedRequest, per-process Counters, AgentHealth); it
never reads BPF maps or /proc. Spans go through the SDK's batch processor (its own thread), so the
ring-buffer reader never waits on an exporter. Attribute names: OTel semantic conventions where
they exist, `mcp.*` for ours (docs/TELEMETRY.md).
"""

from __future__ import annotations

import os
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
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from .. import __version__
from ..core import records as R
from ..core.decode import Counters
from ..requests.join import FinishedRequest
from ..reclaim.rule import Episode
from ..core.timebase import Timebase
from ..exporters import Exporters
from ..exporters.counting import CountingBatchSpanProcessor

SPAN_NAME = "mcp.request"
STALL_SPAN = "mcp.reclaim.stall"
STORM_SPAN = "mcp.reclaim_storm"
LINK_SPAN = "mcp.pcie.link_episode"
STEP_SPAN = "mcp.gpu_step"
KEEP_CLOSED_STORMS = 32
# The batch span processor exports what is queued once per schedule delay (sooner when 512 spans are
# queued), so a span waits for the next export: uniformly over one period plus an export, then the
# export. At 1000 ms the p99 from a request's end to its span at a loopback collector was 1.0-1.1 s
# (bench/bench_latency.py), over the 1 s target; 500 ms leaves half the budget to the export and the
# collector. A wake-up with nothing queued exports nothing; with spans flowing it is one more export
# call a second (~1-3 ms of CPU), and above ~1,000 spans/s the 512-span trigger decides anyway.
SPAN_SCHEDULE_DELAY_MS = 500.0


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


@dataclass
class LinkRef:
    """A PCIe link episode's span, kept so that the GPU's request spans can link to it."""

    span: object
    context: SpanContext
    gpu_bdf: str
    start_ns: int
    end_ns: int | None = None

    def overlaps(self, t0: int, t1: int) -> bool:
        return self.start_ns < t1 and (self.end_ns is None or self.end_ns > t0)


@dataclass
class StormRef:
    """An episode's span, kept so that request spans overlapping it can link to it."""

    episode: Episode
    span: object  # the SDK span, open until the episode closes
    context: SpanContext

    def overlaps(self, t0: int, t1: int) -> bool:
        end = self.episode.end_ns if self.episode.closed else t1
        return self.episode.start_ns < t1 and end > t0


@dataclass
class AgentHealth:
    """The agent's own state, exported as mcp.agent.* metrics and summarised at exit."""

    probes: dict[str, str] = field(default_factory=dict)  # probe -> attached|missing|disabled
    compile_s: float = 0.0
    kernel_stats: dict[str, int] = field(default_factory=dict)  # enum mcp_stat label -> total
    rejected: Counter = field(default_factory=Counter)  # user-space reasons
    user_lost: int = 0  # records we failed to handle
    requests: Counter = field(default_factory=Counter)  # end_reason -> count
    source_reasons: dict[str, str] = field(default_factory=dict)  # non-BPF source -> why missing
    errors: Counter = field(default_factory=Counter)  # failures survived, by where (tick step, map write)

    def kernel_lost(self) -> int:
        return self.kernel_stats.get("rb_lost", 0) + self.kernel_stats.get("rb_req_lost", 0)


# struct mcp_counters field -> request span attribute (docs/TELEMETRY.md). A field of a probe family
# that is not attached stays 0 and is left off the span, except the foundation's four.
COUNTER_ATTRS = {
    "faults": "mcp.faults.user",
    "vcsw": "mcp.ctx_switches.voluntary",
    "ivcsw": "mcp.ctx_switches.involuntary",
    "offcpu_ns": "mcp.offcpu_ns",
    "direct_reclaims": "mcp.reclaim.direct.count",
    "direct_reclaim_ns": "mcp.reclaim.direct.stall_ns",
    "memcg_reclaims": "mcp.reclaim.memcg.count",
    "memcg_reclaim_ns": "mcp.reclaim.memcg.stall_ns",
    "reclaimed_pages": "mcp.reclaim.pages",
    "kswapd_wakeups": "mcp.reclaim.kswapd_wakeups",
    "cu_launch": "mcp.cuda.launches.cuLaunchKernel",
    "cu_launch_ptsz": "mcp.cuda.launches.cuLaunchKernel_ptsz",
    "cu_launch_ex": "mcp.cuda.launches.cuLaunchKernelEx",
    "cu_launch_ex_ptsz": "mcp.cuda.launches.cuLaunchKernelEx_ptsz",
    "cu_graph_launch": "mcp.cuda.graph_launches",
    "cu_ctx_ops": "mcp.cuda.ctx.count",
    "cu_ctx_ns": "mcp.cuda.ctx.ns",
    "cu_syncs": "mcp.cuda.sync.count",
    "cu_sync_ns": "mcp.cuda.sync.wait_ns",
    "cu_allocs": "mcp.cuda.alloc.count",
    "cu_alloc_ns": "mcp.cuda.alloc.ns",
    "cu_frees": "mcp.cuda.free.count",
    "cu_free_ns": "mcp.cuda.free.ns",
    "nv_ioctls": "mcp.nvidia.ioctl.count",
    "nv_ioctl_ns": "mcp.nvidia.ioctl.ns",
    "sampled": "mcp.cuda.sampled",
}
ALWAYS_SHOWN = {"faults", "vcsw", "ivcsw", "offcpu_ns"}


def request_attributes(fr: FinishedRequest, proc_attrs: dict) -> dict:
    attrs = dict(proc_attrs)
    attrs.update({
        "process.pid": fr.tgid,
        "thread.id": fr.tid,
        "mcp.request.id": f"{fr.request_id:016x}",
        "mcp.request.end_reason": fr.end_reason,
        "mcp.request.traceparent": fr.traceparent_state,
        "mcp.cgroup.id": fr.cgroup_id,
    })
    for field, name in COUNTER_ATTRS.items():
        value = getattr(fr.counters, field)
        if value or field in ALWAYS_SHOWN:
            attrs[name] = value
    return attrs


def episode_attributes(ep: Episode) -> dict:
    attrs = {
        "mcp.storm.scope": ep.scope,
        "mcp.storm.windows": ep.windows,
        "mcp.storm.peak.kswapd_ratio": round(ep.peak_kswapd_ratio, 4),
        "mcp.storm.peak.direct_stall_ms_per_s": round(ep.peak_direct_ms_per_s, 3),
        "mcp.storm.peak.memcg_stall_ms_per_s": round(ep.peak_memcg_ms_per_s, 3),
    }
    attrs.update({f"mcp.storm.{k}": v for k, v in ep.totals.items()})
    attrs.update({f"mcp.storm.peak.{k}": v for k, v in ep.peaks.items()})
    return attrs


class Telemetry:
    def __init__(self, *, service_name: str, exporters: Exporters, timebase: Timebase, health: AgentHealth,
                 max_queue_size: int = 8192, metric_interval_s: float = 10.0, schedule_delay_ms: float | None = None):
        self.timebase = timebase
        self.health = health
        self.stats = exporters.stats
        self._lock = threading.Lock()
        self._proc_rows: dict[int, tuple[dict, Counters]] = {}
        self._storms: list[StormRef] = []
        self._link_eps: dict[int, LinkRef] = {}
        self._proc_faults: dict[int, tuple[int, int]] = {}
        self._cuda: tuple | None = None
        self._reclaim: dict = {}
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
        self._instruments()

    # ---- spans ----
    def emit_request(self, fr: FinishedRequest, proc_attrs: dict, extra: dict | None = None,
                     gpu_bdfs: set[str] = frozenset(), events: list | None = None) -> None:
        ctx = None
        if fr.parent is not None:
            parent = SpanContext(fr.parent.trace_id, fr.parent.span_id, is_remote=True,
                                 trace_flags=TraceFlags(fr.parent.flags & 0x01))
            ctx = trace.set_span_in_context(NonRecordingSpan(parent))
        attrs = request_attributes(fr, proc_attrs)
        attrs.update(extra or {})
        storms = [st for st in self._storms if st.overlaps(fr.begin_ns, fr.end_ns)]
        links = [Link(st.context, {"mcp.link.type": "reclaim_storm", "mcp.storm.scope": st.episode.scope})
                 for st in storms]
        pcie = [lr for lr in self._link_eps.values() if lr.gpu_bdf in gpu_bdfs and lr.overlaps(fr.begin_ns, fr.end_ns)]
        links += [Link(lr.context, {"mcp.link.type": "pcie_link_episode", "mcp.pcie.gpu_bdf": lr.gpu_bdf})
                  for lr in pcie]
        wall = self.timebase.to_wall_ns
        span = self.tracer.start_span(SPAN_NAME, context=ctx, kind=SpanKind.INTERNAL,
                                      start_time=wall(fr.begin_ns), attributes=attrs, links=links)
        for st in storms:
            span.add_event("mcp.reclaim_storm", {"mcp.storm.scope": st.episode.scope,
                                                 "mcp.storm.trace_id": f"{st.context.trace_id:032x}",
                                                 "mcp.storm.span_id": f"{st.context.span_id:016x}"},
                           timestamp=wall(max(fr.begin_ns, st.episode.start_ns)))
        for lr in pcie:
            span.add_event("mcp.pcie.link_episode", {"mcp.pcie.gpu_bdf": lr.gpu_bdf,
                                                     "mcp.pcie.span_id": f"{lr.context.span_id:016x}"},
                           timestamp=wall(max(fr.begin_ns, lr.start_ns)))
        for name, t_ns, ev_attrs in events or ():
            span.add_event(name, clean(ev_attrs), timestamp=wall(t_ns))
        child_ctx = trace.set_span_in_context(span)
        for stall in fr.stalls:
            self.tracer.start_span(STALL_SPAN, context=child_ctx, start_time=wall(stall.begin_ns), attributes={
                "thread.id": stall.hdr.tid, "mcp.reclaim.kind": stall.kind, "mcp.reclaim.pages": stall.nr_reclaimed,
                "mcp.reclaim.order": stall.order, "mcp.reclaim.gfp_flags": f"0x{stall.gfp_flags:x}",
                "mcp.reclaim.stall_ns": stall.stall_ns,
            }).end(end_time=wall(stall.hdr.ts_ns))
        if fr.is_error:
            span.set_status(Status(StatusCode.ERROR, f"request ended: {fr.end_reason}"))
        span.end(end_time=wall(max(fr.end_ns, fr.begin_ns)))
        self._duration.record((fr.end_ns - fr.begin_ns) / 1e6, {
            "process.executable.name": proc_attrs.get("process.executable.name", ""),
            "mcp.request.end_reason": fr.end_reason})
        with self._lock:
            self.health.requests[fr.end_reason] += 1

    # ---- reclaim storms ----
    def storm_open(self, ep: Episode, attrs: dict | None = None) -> None:
        span = self.tracer.start_span(STORM_SPAN, kind=SpanKind.INTERNAL, start_time=self.timebase.to_wall_ns(ep.start_ns),
                                      attributes={"mcp.storm.scope": ep.scope, **(attrs or {})})
        self._storms.append(StormRef(ep, span, span.get_span_context()))

    def storm_close(self, ep: Episode) -> None:
        for st in self._storms:
            if st.episode is ep:
                st.span.set_attributes(episode_attributes(ep))
                st.span.end(end_time=self.timebase.to_wall_ns(max(ep.end_ns, ep.start_ns)))
        closed = [st for st in self._storms if st.episode.closed]
        for st in closed[:-KEEP_CLOSED_STORMS]:
            self._storms.remove(st)

    def open_storms(self) -> list[Episode]:
        return [st.episode for st in self._storms if not st.episode.closed]

    # ---- CUDA ----
    def emit_gpu_step(self, step, proc_attrs: dict) -> None:
        """Zero-touch mode: one GPU step (launches since the thread's previous sync, closed by a sync)
        of a process that marks no requests, as a root span `mcp.gpu_step`."""
        attrs = dict(proc_attrs)
        attrs.update({"thread.id": step.hdr.tid, "mcp.gpu_step.sync_kind": step.sync_kind,
                      "mcp.gpu_step.sync_ns": step.sync_ns})
        attrs.update({name: getattr(step.counters, f) for f, name in COUNTER_ATTRS.items()
                      if getattr(step.counters, f)})
        wall = self.timebase.to_wall_ns
        self.tracer.start_span(STEP_SPAN, kind=SpanKind.INTERNAL, start_time=wall(step.begin_ns),
                               attributes=attrs).end(end_time=wall(max(step.hdr.ts_ns, step.begin_ns)))

    def set_cuda(self, governor: dict, ioctls: list[dict], hists: list[dict]) -> None:
        with self._lock:
            self._cuda = (governor, ioctls, hists)

    def _cuda_instruments(self, m) -> None:
        def rows(i, fn):
            def cb(options):
                with self._lock:
                    data = self._cuda
                return [Observation(v, a) for v, a in fn(data[i])] if data else []
            return [cb]

        m.create_observable_gauge("mcp.cuda.governor", rows(0, lambda g: [
            (g[k], {"mcp.governor.field": k}) for k in ("budget", "cost_ns", "duty", "unsteered", "launch_rate_hz",
                                                        "attached_overhead", "overhead") if g.get(k) is not None]),
            description="launch-probe governor: budget, measured per-hit cost, duty cycle, estimated overhead")
        m.create_observable_counter("mcp.nvidia.ioctls", rows(1, lambda rs: [
            (r["count"], {"process.pid": r["pid"], "mcp.nvidia.device": r["device"], "mcp.nvidia.ioctl.cmd": r["cmd"]})
            for r in rs]), description="ioctls on NVIDIA device files by request code")
        m.create_observable_counter("mcp.nvidia.ioctl_ns", rows(1, lambda rs: [
            (r["ns"], {"process.pid": r["pid"], "mcp.nvidia.device": r["device"], "mcp.nvidia.ioctl.cmd": r["cmd"]})
            for r in rs]), unit="ns")
        m.create_observable_counter("mcp.cuda.latency", rows(2, lambda rs: [
            (r["count"], {"process.pid": r["pid"], "mcp.cuda.kind": r["kind"], "mcp.latency.le_ns": r["le_ns"]})
            for r in rs]), description="latency of ctx switches, syncs, allocs, frees, NVIDIA ioctls: log2 buckets")

    # ---- PCIe link episodes ----
    def link_episode(self, ep) -> None:
        """pcie.LinkEpisode: opened -> span started at the episode's start; updated -> span event;
        closed -> span ended. Closed ones are kept a while for request spans that end later."""
        wall = self.timebase.to_wall_ns
        ref = self._link_eps.get(ep.episode_id)
        if ep.event == "opened" or ref is None:
            span = self.tracer.start_span(LINK_SPAN, kind=SpanKind.INTERNAL, start_time=wall(ep.start_ns),
                                          attributes=clean(ep.attributes()))
            ref = self._link_eps[ep.episode_id] = LinkRef(span, span.get_span_context(), ep.gpu_bdf, ep.start_ns)
        if ep.event == "updated":
            ref.span.add_event("mcp.pcie.link_update", clean(ep.attributes()), timestamp=wall(ep.t_ns))
        elif ep.event == "closed":
            ref.span.set_attributes(clean(ep.attributes()))
            ref.end_ns = ep.end_ns or ep.t_ns
            ref.span.end(end_time=wall(ref.end_ns))
            closed = [k for k, r in self._link_eps.items() if r.end_ns is not None]
            for k in closed[:-KEEP_CLOSED_STORMS]:
                del self._link_eps[k]

    def watch_gpus(self, gpu) -> None:
        """Register GPU, PCIe link and NIC metrics read from the gpuhealth sources' snapshots."""
        m = self.meter_provider.get_meter("mcp_hostagent", __version__)

        def per_gpu(fn):
            def cb(options):
                out = []
                for s in gpu.sampler.snapshot().values():
                    base = {"mcp.gpu.index": s.index, "mcp.gpu.uuid": s.uuid or "", "mcp.gpu.pci_bus_id": s.pci_bus_id or ""}
                    for v, extra in fn(s):
                        if v is not None:
                            out.append(Observation(v, {**base, **extra}))
                return out
            return [cb]

        m.create_observable_gauge("mcp.gpu.up", per_gpu(lambda s: [(int(s.up), {})]),
                                  description="1 when the GPU answers NVML, 0 when marked down")
        m.create_observable_gauge("mcp.gpu.utilization", per_gpu(lambda s: [
            (s.util_gpu_pct, {"mcp.gpu.engine": "sm"}), (s.util_mem_pct, {"mcp.gpu.engine": "memory"})]), unit="%")
        m.create_observable_gauge("mcp.gpu.memory.used_bytes", per_gpu(lambda s: [(s.mem_used_bytes, {})]), unit="By")
        m.create_observable_gauge("mcp.gpu.clock_mhz", per_gpu(lambda s: [
            (s.sm_clock_mhz, {"mcp.gpu.clock": "sm"}), (s.mem_clock_mhz, {"mcp.gpu.clock": "memory"})]), unit="MHz")
        m.create_observable_gauge("mcp.gpu.power_mw", per_gpu(lambda s: [(s.power_mw, {})]), unit="mW")
        m.create_observable_gauge("mcp.gpu.temperature_c", per_gpu(lambda s: [(s.temperature_c, {})]), unit="Cel")
        m.create_observable_gauge("mcp.gpu.throttle", per_gpu(lambda s: [
            (1, {"mcp.gpu.throttle_reason": r}) for r in (s.throttle_reasons or ())]),
            description="1 per active clock throttle reason")
        m.create_observable_gauge("mcp.gpu.pcie.link", per_gpu(lambda s: [
            (s.pcie_gen, {"mcp.pcie.field": "gen"}), (s.pcie_gen_max, {"mcp.pcie.field": "gen_max"}),
            (s.pcie_width, {"mcp.pcie.field": "width"}), (s.pcie_width_max, {"mcp.pcie.field": "width_max"})]),
            description="NVML's view of the GPU's PCIe link")
        m.create_observable_counter("mcp.gpu.pcie.replays", per_gpu(lambda s: [(s.pcie_replay_count, {})]))
        m.create_observable_gauge("mcp.gpu.process.memory_bytes", per_gpu(lambda s: [
            (p.used_memory_bytes, {"process.pid": p.pid}) for p in (s.processes or ())]), unit="By")
        m.create_observable_counter("mcp.gpu.xid", [lambda options: [
            Observation(n, {"mcp.gpu.xid": code}) for code, n in dict(gpu.xid.counts).items()]],
            description="Xid errors by code (the nvidia:nvidia_dev_xid BPF probe, else NVML events)")

        def links(options):
            snap = gpu.last_pcie
            out = []
            for bdf, st in (getattr(snap, "links", None) or {}).items():
                base = {"mcp.pcie.bdf": bdf, "mcp.pcie.role": getattr(st, "role", "")}
                for field_, v in (("gen", st.gen), ("gen_max", st.max_gen), ("width", st.width), ("width_max", st.max_width)):
                    if v is not None:
                        out.append(Observation(v, {**base, "mcp.pcie.field": field_}))
            return out

        def aer(options):
            snap = gpu.last_pcie
            return [Observation(st.aer.total(kind), {"mcp.pcie.bdf": bdf, "mcp.pcie.aer.kind": kind})
                    for bdf, st in (getattr(snap, "links", None) or {}).items() if st.aer is not None
                    for kind in ("correctable", "nonfatal", "fatal")]

        m.create_observable_gauge("mcp.pcie.link", [links], description="sysfs link state of GPUs and their bridges")
        m.create_observable_counter("mcp.pcie.aer.errors", [aer], description="AER error counts from sysfs")
        m.create_observable_counter("mcp.pcie.tracepoint_events", [lambda options: [
            Observation(n, {"mcp.pcie.event": ev, "mcp.pcie.bdf": bdf})
            for (ev, bdf), n in dict(gpu.pcie_event_counts).items()]],
            description="ras:aer_event and pci:pcie_link_event records, by device (BPF)")
        m.create_observable_gauge("mcp.pcie.link_episode.active", [lambda options: [
            Observation(sum(1 for r in self._link_eps.values() if r.end_ns is None), {})]])
        m.create_observable_counter("mcp.nic.link_events", [lambda options: [
            Observation(n, {"network.interface.name": ifn, "mcp.nic.event": kind})
            for (ifn, kind), n in dict(gpu.nic_counts).items()]], description="NIC link events (netlink)")

    def set_reclaim(self, snap: dict) -> None:
        """Host reclaim snapshot from the pipeline: totals, kswapd ratios, PSI, stall histogram, cgroups."""
        with self._lock:
            self._reclaim = dict(snap)

    # ---- metrics ----
    def set_process_counters(self, rows: dict[int, tuple[dict, Counters]],
                             faults: dict[int, tuple[int, int]] | None = None) -> None:
        """rows: pid -> (identity attributes, cumulative counters since the agent saw the process);
        faults: pid -> (minflt, majflt) since the process started, from /proc/PID/stat."""
        with self._lock:
            gone = self._proc_rows.keys() - rows.keys()
            self._proc_rows = dict(rows)
            self._proc_faults = dict(faults or {})
        if gone:
            self._forget_processes(gone)

    def _forget_processes(self, pids: set[int]) -> None:
        """Drop the SDK's state for processes no longer reported. The SDK keeps every attribute set an
        asynchronous instrument ever observed: memory grew with every process the host ever ran, and
        from the 2,000th set (its default cardinality limit) each instrument merged new processes into
        one `otel.metric.overflow` point (~3 minutes of `--watch all` on a host starting 10 processes a
        second). SDK internals, read with getattr: an SDK that renames them forgets nothing, as before."""
        consumer = getattr(self.meter_provider, "_measurement_consumer", None)
        for storage in list(getattr(consumer, "_reader_storages", {}).values()):
            for inst, matches in list(getattr(storage, "_instrument_view_instrument_matches", {}).items()):
                if not str(getattr(inst, "name", "")).startswith("mcp.process."):
                    continue
                for match in matches:
                    aggs, lock = getattr(match, "_attributes_aggregation", None), getattr(match, "_lock", None)
                    if not isinstance(aggs, dict) or lock is None:
                        continue
                    with lock:
                        for key in [k for k, a in aggs.items()
                                    if (getattr(a, "_attributes", None) or {}).get("process.pid") in pids]:
                            del aggs[key]

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
        def faults_cb(options):
            with self._lock:
                rows = [(self._proc_rows[p][0], f) for p, f in self._proc_faults.items() if p in self._proc_rows]
            return [Observation(v, {**a, "mcp.fault.type": t}) for a, (mn, mj) in rows
                    for v, t in ((mn, "minor"), (mj, "major"))]

        m.create_observable_counter("mcp.process.faults", [faults_cb], unit="{fault}",
                                    description="faults by type since the process started (/proc/PID/stat)")
        m.create_observable_counter("mcp.process.reclaim_stall_ns", [self._proc_obs(lambda c: [
            (c.direct_reclaim_ns, {"mcp.reclaim.kind": "direct"}), (c.memcg_reclaim_ns, {"mcp.reclaim.kind": "memcg"})])],
            unit="ns", description="time the process's threads stalled in reclaim")
        m.create_observable_counter("mcp.process.reclaims", [self._proc_obs(lambda c: [
            (c.direct_reclaims, {"mcp.reclaim.kind": "direct"}), (c.memcg_reclaims, {"mcp.reclaim.kind": "memcg"})])],
            unit="{stall}", description="reclaim stalls of the process's threads")
        self._reclaim_instruments(m)
        self._cuda_instruments(m)
        m.create_observable_counter("mcp.process.cuda_launches", [self._proc_obs(lambda c: [
            (c.cu_launch + c.cu_launch_ptsz + c.cu_launch_ex + c.cu_launch_ex_ptsz, {}),
        ])], description="kernel launches seen by the libcuda uprobes (scaled when duty-cycled)")
        m.create_observable_counter("mcp.process.cuda_sync_ns", [self._proc_obs(lambda c: [(c.cu_sync_ns, {})])],
                                    unit="ns", description="time in cuStreamSynchronize/cuCtxSynchronize/cuEventSynchronize")
        m.create_observable_counter("mcp.process.cuda_ctx_ns", [self._proc_obs(lambda c: [(c.cu_ctx_ns, {})])],
                                    unit="ns", description="time in cuCtxPush/Pop/SetCurrent")
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
            (v, {"mcp.reason": k}) for k, v in self.rejected().items()]),
            description="markers and records rejected, by reason")
        m.create_observable_counter("mcp.agent.errors", obs(lambda: [
            (v, {"mcp.where": k}) for k, v in sorted(h.errors.items())]),
            description="failures the agent caught and survived, by where (a tick step, a map write)")
        m.create_observable_counter("mcp.agent.spans.exported", obs(lambda: [
            (self.stats.snapshot().get("spans_exported", 0), {})]), description="spans the exporters accepted")
        m.create_observable_counter("mcp.agent.spans.dropped", obs(lambda: [
            (self.stats.snapshot().get("spans_dropped_queue", 0), {"mcp.reason": "queue_full"}),
            (self.stats.snapshot().get("spans_failed", 0), {"mcp.reason": "export_failed"})]),
            description="spans not delivered")

    def _reclaim_instruments(self, m) -> None:
        def obs(key):
            def cb(options):
                with self._lock:
                    rows = self._reclaim.get(key, [])
                return [Observation(v, a) for v, a in rows]
            return [cb]

        m.create_observable_counter("mcp.reclaim.stall_ns", obs("stall_ns"), unit="ns",
                                    description="host reclaim stall time by kind (direct, memcg)")
        m.create_observable_counter("mcp.reclaim.stalls", obs("stalls"), unit="{stall}",
                                    description="reclaim stalls by kind and log2 bucket upper bound mcp.stall.le_ns")
        m.create_observable_counter("mcp.reclaim.pages", obs("pages"), unit="{page}",
                                    description="pages scanned / reclaimed by reclaimer (kswapd, direct, memcg)")
        m.create_observable_gauge("mcp.reclaim.kswapd.active_ratio", obs("kswapd_ratio"),
                                  description="share of the last window kswapd was awake, per NUMA node")
        m.create_observable_gauge("mcp.reclaim.kswapd.cpu_ratio", obs("kswapd_cpu"),
                                  description="kswapd CPU time over the last window, per node (/proc/PID/stat)")
        m.create_observable_gauge("mcp.memory.psi.avg10", obs("psi"),
                                  description="memory pressure stall information (some/full avg10, %), host and cgroups")
        m.create_observable_gauge("mcp.reclaim.storm.active", obs("storm_active"),
                                  description="1 while a reclaim storm episode is open, per scope")
        m.create_observable_counter("mcp.cgroup.reclaim_stall_ns", obs("cgroup_stall_ns"), unit="ns",
                                    description="reclaim stall time of the cgroup's tasks, by kind")
        m.create_observable_counter("mcp.host.page_faults", obs("host_faults"), unit="{fault}",
                                    description="host page faults by type (minor, major) from /proc/vmstat")

    def rejected(self) -> dict[str, int]:
        """Records and markers refused or dropped, by reason: the kernel's and user space's."""
        out = {k: v for k, v in self.health.kernel_stats.items() if k not in R.ACTIVITY_STATS}
        for k, v in self.health.rejected.items():
            out[k] = out.get(k, 0) + v
        return out

    def flush(self, timeout_s: float = 3.0) -> None:
        self.tracer_provider.force_flush(int(timeout_s * 1000))
        self.meter_provider.force_flush(int(timeout_s * 1000))

    def shutdown(self, timeout_s: float = 3.0, now_ns: int | None = None) -> None:
        for st in self._storms:  # an episode still open at exit is exported, marked unfinished
            if not st.episode.closed:
                st.span.set_attributes({**episode_attributes(st.episode), "mcp.storm.unfinished": True})
                st.span.end()
        self.flush(timeout_s)
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown(timeout_millis=timeout_s * 1000)
