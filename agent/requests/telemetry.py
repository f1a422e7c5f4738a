"""Finished requests -> request span specs (docs/TELEMETRY.md): the counters the kernel kept for the
request's thread, its reclaim stalls as child spans, and the evidence other capabilities add."""

from __future__ import annotations

from ..telemetry.spec import Instrument, SpanSpec
from .join import FinishedRequest

SPAN_NAME = "hostagent.request"
STALL_SPAN = "hostagent.reclaim.stall"
DURATION = "hostagent.request.duration"

# struct mcp_counters field -> request span attribute (docs/TELEMETRY.md). A field of a probe family
# that is not attached stays 0 and is left off the span, except the foundation's four. Fields the kernel
# keeps in ns (TIME_FIELDS) are exported in seconds: OTel's base unit for time, and the names say
# `.time`, never the unit.
COUNTER_ATTRS = {
    "faults": "hostagent.faults.user",
    "vcsw": "hostagent.context_switches.voluntary",
    "ivcsw": "hostagent.context_switches.involuntary",
    "offcpu_ns": "hostagent.offcpu.time",
    "direct_reclaims": "hostagent.reclaim.direct.count",
    "direct_reclaim_ns": "hostagent.reclaim.direct.stall.time",
    "memcg_reclaims": "hostagent.reclaim.memcg.count",
    "memcg_reclaim_ns": "hostagent.reclaim.memcg.stall.time",
    "reclaimed_pages": "hostagent.reclaim.pages",
    "kswapd_wakeups": "hostagent.reclaim.kswapd_wakeups",
    "cu_launch": "hostagent.cuda.launches.cuLaunchKernel",
    "cu_launch_ptsz": "hostagent.cuda.launches.cuLaunchKernel_ptsz",
    "cu_launch_ex": "hostagent.cuda.launches.cuLaunchKernelEx",
    "cu_launch_ex_ptsz": "hostagent.cuda.launches.cuLaunchKernelEx_ptsz",
    "cu_graph_launch": "hostagent.cuda.graph_launches",
    "cu_ctx_ops": "hostagent.cuda.ctx.count",
    "cu_ctx_ns": "hostagent.cuda.ctx.time",
    "cu_syncs": "hostagent.cuda.sync.count",
    "cu_sync_ns": "hostagent.cuda.sync.time",
    "cu_allocs": "hostagent.cuda.alloc.count",
    "cu_alloc_ns": "hostagent.cuda.alloc.time",
    "cu_frees": "hostagent.cuda.free.count",
    "cu_free_ns": "hostagent.cuda.free.time",
    "nv_ioctls": "hostagent.nvidia.ioctl.count",
    "nv_ioctl_ns": "hostagent.nvidia.ioctl.time",
    "sampled": "hostagent.cuda.sampled",
    "offcpu_runnable_ns": "hostagent.offcpu.runnable.time",
    "wakeup_wait_ns": "hostagent.offcpu.wakeup_wait.time",
    "wakeups": "hostagent.offcpu.wakeups",
    "cu_alloc_oom": "hostagent.cuda.alloc.out_of_memory",
    "oncpu_ns": "hostagent.oncpu.time",
    "pagecache_added_bytes": "hostagent.page_cache.added.size",
}
NUMA_REMOTE_TIME = "hostagent.numa.remote.time"
NUMA_REMOTE_RATIO = "hostagent.numa.remote.ratio"
ALWAYS_SHOWN = {"faults", "vcsw", "ivcsw", "offcpu_ns"}
TIME_FIELDS = frozenset(f for f in COUNTER_ATTRS if f.endswith("_ns"))

INSTRUMENTS = (Instrument(DURATION, "histogram", "s", "marked request duration (exponential buckets)"),)


def counter_attributes(counters, always: set[str] = frozenset()) -> dict:
    attrs = {name: getattr(counters, f) / 1e9 if f in TIME_FIELDS else getattr(counters, f)
             for f, name in COUNTER_ATTRS.items() if getattr(counters, f) or f in always}
    # Remote time only where the process had a home node for some of the window: 0 then is a
    # measured 0; without a home there is nothing to be remote from, and the attributes are absent.
    if counters.oncpu_homed_ns:
        attrs[NUMA_REMOTE_TIME] = counters.oncpu_remote_ns / 1e9
        attrs[NUMA_REMOTE_RATIO] = round(counters.oncpu_remote_ns / counters.oncpu_homed_ns, 4)
    return attrs


def request_attributes(fr: FinishedRequest) -> dict:
    """The span's own attributes; the process's identity is its resource (request_span)."""
    attrs = {
        "process.pid": fr.tgid,
        "thread.id": fr.tid,
        "hostagent.request.id": f"{fr.request_id:016x}",
        "hostagent.request.source": "marker",  # agent/http sets "http"
        "hostagent.request.end_reason": fr.end_reason,
        "hostagent.request.traceparent": fr.traceparent_state,
        "hostagent.cgroup.id": fr.cgroup_id,
    }
    attrs.update(counter_attributes(fr.counters, ALWAYS_SHOWN))
    attrs.update(fr.attributes)
    for scope, counters in fr.scopes:  # "process", "group": hostagent.faults.user -> hostagent.<scope>.faults.user
        attrs.update({scoped(name, scope): v for name, v in counter_attributes(counters, ALWAYS_SHOWN).items()})
    return attrs


def scoped(name: str, scope: str) -> str:
    return name.replace("hostagent.", f"hostagent.request.{scope}.", 1)


def stall_span(stall) -> SpanSpec:
    return SpanSpec(STALL_SPAN, stall.begin_ns, stall.hdr.ts_ns, {
        "thread.id": stall.hdr.tid, "hostagent.reclaim.kind": stall.kind, "hostagent.reclaim.pages": stall.nr_reclaimed,
        "hostagent.reclaim.order": stall.order, "hostagent.reclaim.gfp_flags": f"0x{stall.gfp_flags:x}",
        "hostagent.reclaim.stall.time": stall.stall_ns / 1e9})


def request_span(fr: FinishedRequest, proc_attrs: dict, evidence) -> SpanSpec:
    """evidence: core.capability.Evidence gathered from the other capabilities for this window."""
    attrs = request_attributes(fr)
    attrs.update(evidence.attributes)
    return SpanSpec(SPAN_NAME, fr.begin_ns, fr.end_ns, attrs, parent=fr.parent, links=evidence.links,
                    events=evidence.events, children=tuple(stall_span(s) for s in fr.stalls),
                    error=fr.error_text if fr.is_error else None, resource=proc_attrs)


# hostagent.request.duration's labels: whose requests, boundedly. The executable's name alone is
# anybody's to choose (another user's binary named `vllm` would merge into the real vLLM's series), so
# its owner (process.owner: a user name, or the uid where it has none) and, where the agent knows them,
# its container and pod split the series by who could have started it. No pid, command line, start
# time or cgroup path: one series per process or per argv would be unbounded.
DURATION_IDENTITY = ("process.owner", "container.id", "k8s.pod.uid")


def duration_row(fr: FinishedRequest, proc_attrs: dict) -> tuple[float, dict]:
    labels = {"process.executable.name": proc_attrs.get("process.executable.name", "")}
    labels.update({k: proc_attrs[k] for k in DURATION_IDENTITY if proc_attrs.get(k)})
    labels["hostagent.request.end_reason"] = fr.end_reason
    return (fr.end_ns - fr.begin_ns) / 1e9, labels
