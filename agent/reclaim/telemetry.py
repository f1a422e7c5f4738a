"""Reclaim -> telemetry: storm episode spans, the attributes of a cgroup scope, and the host reclaim
metrics (docs/TELEMETRY.md)."""

from __future__ import annotations

from ..core.identity import container_from_cgroup_path
from ..telemetry.spec import Instrument, SpanSpec
from .rule import Episode

STORM_SPAN = "mcp.reclaim_storm"


def cgroup_attrs(path: str) -> dict:
    ref = container_from_cgroup_path(path)
    attrs = {"mcp.cgroup.path": path}
    if ref and ref.container_id:
        attrs["container.id"] = ref.container_id
    if ref and ref.pod_uid:
        attrs["k8s.pod.uid"] = ref.pod_uid
    return attrs


def storm_span(ep: Episode) -> SpanSpec:
    """Opened when the episode opens; its attributes are set when it closes (episode_attributes)."""
    attrs = {} if ep.scope == "host" else cgroup_attrs(ep.scope)
    return SpanSpec(STORM_SPAN, ep.start_ns, None, {"mcp.storm.scope": ep.scope, **attrs})


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


INSTRUMENTS = (
    Instrument("mcp.reclaim.stall_ns", "counter", "ns", "host reclaim stall time by kind (direct, memcg)"),
    Instrument("mcp.reclaim.stalls", "counter", "{stall}",
               "reclaim stalls by kind and log2 bucket upper bound mcp.stall.le_ns"),
    Instrument("mcp.reclaim.pages", "counter", "{page}", "pages scanned / reclaimed by reclaimer (kswapd, direct, memcg)"),
    Instrument("mcp.reclaim.kswapd.active_ratio", "gauge", "", "share of the last window kswapd was awake, per NUMA node"),
    Instrument("mcp.reclaim.kswapd.cpu_ratio", "gauge", "", "kswapd CPU time over the last window, per node (/proc/PID/stat)"),
    Instrument("mcp.memory.psi.avg10", "gauge", "",
               "memory pressure stall information (some/full avg10, %), host and cgroups"),
    Instrument("mcp.reclaim.storm.active", "gauge", "", "1 while a reclaim storm episode is open, per scope"),
    Instrument("mcp.cgroup.reclaim_stall_ns", "counter", "ns", "reclaim stall time of the cgroup's tasks, by kind"),
    Instrument("mcp.host.page_faults", "counter", "{fault}", "host page faults by type (minor, major) from /proc/vmstat"),
)


def window_rows(t: dict, hist: dict, ratios: dict, kswapd_cpu: dict, psi: dict, storms: dict, cg_totals: dict,
                vm: dict) -> dict:
    """One closed window's metric rows, by instrument name. t: reclaim_totals by name; hist:
    (kind, le_ns) -> stalls; ratios / kswapd_cpu: node -> share; psi: /proc/pressure/memory;
    storms: scope -> open?; cg_totals: cgroup path -> [direct_ns, memcg_ns]; vm: /proc/vmstat."""
    return {
        "mcp.reclaim.stall_ns": [(t["direct_ns"], {"mcp.reclaim.kind": "direct"}),
                                 (t["memcg_ns"], {"mcp.reclaim.kind": "memcg"})],
        "mcp.reclaim.stalls": [(n, {"mcp.reclaim.kind": k, "mcp.stall.le_ns": le}) for (k, le), n in sorted(hist.items())],
        "mcp.reclaim.pages": [(t[f"{op}_{who}"], {"mcp.reclaim.by": who,
                                                  "mcp.reclaim.op": "scanned" if op == "scan" else "reclaimed"})
                              for who in ("kswapd", "direct", "memcg") for op in ("scan", "steal")],
        "mcp.reclaim.kswapd.active_ratio": [(r, {"mcp.numa.node": n}) for n, r in sorted(ratios.items())],
        "mcp.reclaim.kswapd.cpu_ratio": [(r, {"mcp.numa.node": n}) for n, r in sorted(kswapd_cpu.items())],
        "mcp.memory.psi.avg10": [(v.get("avg10", 0.0), {"mcp.psi.kind": k, "mcp.psi.scope": "host"})
                                 for k, v in psi.items()],
        "mcp.reclaim.storm.active": [(int(active), {"mcp.storm.scope": s}) for s, active in storms.items()],
        "mcp.cgroup.reclaim_stall_ns": [(v, {**cgroup_attrs(p), "mcp.reclaim.kind": k})
                                        for p, tot in cg_totals.items() for k, v in zip(("direct", "memcg"), tot)],
        "mcp.host.page_faults": [(vm.get("pgfault", 0) - vm.get("pgmajfault", 0), {"mcp.fault.type": "minor"}),
                                 (vm.get("pgmajfault", 0), {"mcp.fault.type": "major"})],
    }
