"""Finished requests -> request span specs (docs/TELEMETRY.md): the counters the kernel kept for the
request's thread, its reclaim stalls as child spans, and the evidence other capabilities add."""

from __future__ import annotations

from ..telemetry.spec import Instrument, SpanSpec
from .join import FinishedRequest

SPAN_NAME = "mcp.request"
STALL_SPAN = "mcp.reclaim.stall"
DURATION = "mcp.request.duration_ms"

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

INSTRUMENTS = (Instrument(DURATION, "histogram", "ms", "marked request duration"),)


def counter_attributes(counters, always: set[str] = frozenset()) -> dict:
    return {name: getattr(counters, f) for f, name in COUNTER_ATTRS.items() if getattr(counters, f) or f in always}


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
    attrs.update(counter_attributes(fr.counters, ALWAYS_SHOWN))
    return attrs


def stall_span(stall) -> SpanSpec:
    return SpanSpec(STALL_SPAN, stall.begin_ns, stall.hdr.ts_ns, {
        "thread.id": stall.hdr.tid, "mcp.reclaim.kind": stall.kind, "mcp.reclaim.pages": stall.nr_reclaimed,
        "mcp.reclaim.order": stall.order, "mcp.reclaim.gfp_flags": f"0x{stall.gfp_flags:x}",
        "mcp.reclaim.stall_ns": stall.stall_ns})


def request_span(fr: FinishedRequest, proc_attrs: dict, evidence) -> SpanSpec:
    """evidence: core.capability.Evidence gathered from the other capabilities for this window."""
    attrs = request_attributes(fr, proc_attrs)
    attrs.update(evidence.attributes)
    return SpanSpec(SPAN_NAME, fr.begin_ns, fr.end_ns, attrs, parent=fr.parent, links=evidence.links,
                    events=evidence.events, children=tuple(stall_span(s) for s in fr.stalls),
                    error=f"request ended: {fr.end_reason}" if fr.is_error else None)


def duration_row(fr: FinishedRequest, proc_attrs: dict) -> tuple[float, dict]:
    return (fr.end_ns - fr.begin_ns) / 1e6, {
        "process.executable.name": proc_attrs.get("process.executable.name", ""),
        "mcp.request.end_reason": fr.end_reason}
