"""Reclaim -> telemetry: storm episode spans, the attributes of a cgroup scope, and the host reclaim
metrics (docs/TELEMETRY.md)."""

from __future__ import annotations

from ..core.identity import container_from_cgroup_path
from ..telemetry.spec import Instrument, Log2Buckets, SpanSpec
from .rule import Episode

STORM_SPAN = "hostagent.reclaim_storm"


def cgroup_attrs(path: str) -> dict:
    ref = container_from_cgroup_path(path)
    attrs = {"hostagent.cgroup.path": path}
    if ref and ref.container_id:
        attrs["container.id"] = ref.container_id
    if ref and ref.pod_uid:
        attrs["k8s.pod.uid"] = ref.pod_uid
    return attrs


def storm_span(ep: Episode) -> SpanSpec:
    """Opened when the episode opens; its attributes are set when it closes (episode_attributes)."""
    attrs = {} if ep.scope == "host" else cgroup_attrs(ep.scope)
    return SpanSpec(STORM_SPAN, ep.start_ns, None, {"hostagent.storm.scope": ep.scope, **attrs})


def episode_attributes(ep: Episode) -> dict:
    attrs = {
        "hostagent.storm.scope": ep.scope,
        "hostagent.storm.windows": ep.windows,
        "hostagent.storm.peak.kswapd.utilization": round(ep.peak_kswapd_ratio, 4),
        "hostagent.storm.peak.direct_stall.ratio": round(ep.peak_direct_ms_per_s / 1000, 6),
        "hostagent.storm.peak.memcg_stall.ratio": round(ep.peak_memcg_ms_per_s / 1000, 6),
    }
    attrs.update({f"hostagent.storm.{k}": v for k, v in ep.totals.items()})
    # PSI peaks as ratios, like every other share we export (/proc/pressure prints percent)
    attrs.update({f"hostagent.storm.peak.{k}": v / 100 if k.startswith("psi_") else v for k, v in ep.peaks.items()})
    return attrs


INSTRUMENTS = (
    Instrument("hostagent.reclaim.stall.time", "counter", "s", "host reclaim stall time by kind (direct, memcg)"),
    Instrument("hostagent.reclaim.stall.duration", "log2_ns", "s",
               "reclaim stall durations by kind (in-kernel log2 buckets)"),
    Instrument("hostagent.reclaim.pages", "counter", "{page}",
               "pages scanned / reclaimed by reclaimer (kswapd, direct, memcg)"),
    Instrument("hostagent.reclaim.kswapd.utilization", "gauge", "1",
               "share of the last window kswapd was awake, per NUMA node"),
    Instrument("hostagent.reclaim.kswapd.cpu.utilization", "gauge", "1",
               "kswapd CPU time over the last window, per node (/proc/PID/stat)"),
    Instrument("hostagent.memory.pressure.avg10", "gauge", "1",
               "memory pressure stall information: share of the last 10 s stalled (some/full), host"),
    Instrument("hostagent.reclaim.storm.active", "gauge", "", "1 while a reclaim storm episode is open, per scope"),
    Instrument("hostagent.cgroup.reclaim.stall.time", "counter", "s", "reclaim stall time of the cgroup's tasks, by kind"),
    Instrument("system.paging.faults", "counter", "{fault}", "host page faults by type (minor, major) from /proc/vmstat"),
    Instrument("hostagent.oom.kills", "counter", "{kill}",
               "OOM kills seen (oom:mark_victim), by hostagent.oom.scope: memcg (the victim's memory cgroup has a"
               " limit below the machine's memory), host, unknown"),
)


def window_rows(t: dict, hist: dict, ratios: dict, kswapd_cpu: dict, psi: dict, storms: dict, cg_totals: dict,
                vm: dict) -> dict:
    """One closed window's metric rows, by instrument name. t: reclaim_totals by name; hist:
    (kind, log2 slot) -> stalls; ratios / kswapd_cpu: node -> share; psi: /proc/pressure/memory;
    storms: scope -> open?; cg_totals: cgroup path -> [direct_ns, memcg_ns]; vm: /proc/vmstat."""
    return {
        "hostagent.reclaim.stall.time": [(t["direct_ns"] / 1e9, {"hostagent.reclaim.kind": "direct"}),
                                         (t["memcg_ns"] / 1e9, {"hostagent.reclaim.kind": "memcg"})],
        "hostagent.reclaim.stall.duration": [
            (Log2Buckets({slot: n for (k, slot), n in hist.items() if k == kind}), {"hostagent.reclaim.kind": kind})
            for kind in sorted({k for k, _ in hist})],
        "hostagent.reclaim.pages": [(t[f"{op}_{who}"], {"hostagent.reclaim.by": who,
                                                  "hostagent.reclaim.op": "scanned" if op == "scan" else "reclaimed"})
                              for who in ("kswapd", "direct", "memcg") for op in ("scan", "steal")],
        "hostagent.reclaim.kswapd.utilization": [(r, {"hostagent.numa.node": n}) for n, r in sorted(ratios.items())],
        "hostagent.reclaim.kswapd.cpu.utilization": [(r, {"hostagent.numa.node": n}) for n, r in sorted(kswapd_cpu.items())],
        "hostagent.memory.pressure.avg10": [(v.get("avg10", 0.0) / 100, {"hostagent.psi.kind": k, "hostagent.psi.scope": "host"})
                                 for k, v in psi.items()],
        "hostagent.reclaim.storm.active": [(int(active), {"hostagent.storm.scope": s}) for s, active in storms.items()],
        "hostagent.cgroup.reclaim.stall.time": [(v / 1e9, {**cgroup_attrs(p), "hostagent.reclaim.kind": k})
                                        for p, tot in cg_totals.items() for k, v in zip(("direct", "memcg"), tot)],
        "system.paging.faults": [(vm.get("pgfault", 0) - vm.get("pgmajfault", 0), {"system.paging.fault.type": "minor"}),
                                 (vm.get("pgmajfault", 0), {"system.paging.fault.type": "major"})],
    }


STALL_SPAN = "hostagent.reclaim.stall"


def stall_span(stall) -> SpanSpec:
    """One stall over the threshold inside a request: a child span of the request's."""
    return SpanSpec(STALL_SPAN, stall.begin_ns, stall.hdr.ts_ns, {
        "thread.id": stall.hdr.tid, "hostagent.reclaim.kind": stall.kind, "hostagent.reclaim.pages": stall.nr_reclaimed,
        "hostagent.reclaim.order": stall.order, "hostagent.reclaim.gfp_flags": f"0x{stall.gfp_flags:x}",
        "hostagent.reclaim.stall.time": stall.stall_ns / 1e9})


def process_instruments(processes) -> list[Instrument]:
    """Reclaim's kernel counters per watched process (core/processes.py rows)."""
    p = processes.per_process
    return [
        Instrument("hostagent.process.reclaim.stall.time", "counter", "s",
                   "time the process's threads stalled in reclaim",
                   p(lambda c: [(c.direct_reclaim_ns / 1e9, {"hostagent.reclaim.kind": "direct"}),
                                (c.memcg_reclaim_ns / 1e9, {"hostagent.reclaim.kind": "memcg"})])),
        Instrument("hostagent.process.reclaim.stalls", "counter", "{stall}", "reclaim stalls of the process's threads",
                   p(lambda c: [(c.direct_reclaims, {"hostagent.reclaim.kind": "direct"}),
                                (c.memcg_reclaims, {"hostagent.reclaim.kind": "memcg"})])),
    ]
