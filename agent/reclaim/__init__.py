"""Memory reclaim: direct and memcg reclaim stalls, kswapd, storms per scope, OOM kills
(bpf/reclaim.bpf.c)."""

from ..core.capability import Declaration, RawKind
from ..core.probes import ProbeSpec
from . import oom, records


def _make():
    from .capability import Reclaim
    return Reclaim


CAPABILITY = Declaration(
    name="reclaim", make=_make, bpf="reclaim.bpf.c", header="reclaim.h", structs=records.STRUCTS, settings=records.bpf_settings,
    counters=records.COUNTERS,
    attributes=("hostagent.reclaim.kswapd.overlap.time", "hostagent.oom.killed"),
    raw={records.C["MCP_TP_OOM_MARK_VICTIM"]: RawKind("oom/mark_victim", oom.MARK_VICTIM_FORMAT, oom.decode_mark_victim)},
    probes=(
        ProbeSpec("reclaim_direct_begin", "vmscan:mm_vmscan_direct_reclaim_begin", "reclaim.bpf.c",
                  "direct reclaim stall start, per thread", "needs CONFIG_TRACEPOINTS with vmscan events"),
        ProbeSpec("reclaim_direct_end", "vmscan:mm_vmscan_direct_reclaim_end", "reclaim.bpf.c",
                  "direct reclaim stall ns and pages per request and process", "needs vmscan events"),
        ProbeSpec("reclaim_memcg_begin", "vmscan:mm_vmscan_memcg_reclaim_begin", "reclaim.bpf.c",
                  "memcg (cgroup limit) reclaim stall start", "needs CONFIG_MEMCG"),
        ProbeSpec("reclaim_memcg_end", "vmscan:mm_vmscan_memcg_reclaim_end", "reclaim.bpf.c",
                  "memcg reclaim stall ns and pages per request, process and cgroup", "needs CONFIG_MEMCG"),
        ProbeSpec("kswapd_wake", "vmscan:mm_vmscan_kswapd_wake", "reclaim.bpf.c",
                  "kswapd active intervals per NUMA node (start)", "needs vmscan events"),
        ProbeSpec("kswapd_sleep", "vmscan:mm_vmscan_kswapd_sleep", "reclaim.bpf.c",
                  "kswapd active intervals per NUMA node (end)", "needs vmscan events"),
        ProbeSpec("wakeup_kswapd", "vmscan:mm_vmscan_wakeup_kswapd", "reclaim.bpf.c",
                  "which tasks' allocations woke kswapd", "needs vmscan events"),
        ProbeSpec("reclaim_shrink", "vmscan:mm_vmscan_lru_shrink_inactive", "reclaim.bpf.c",
                  "pages scanned/reclaimed by kswapd, direct and memcg reclaim (cf. /proc/vmstat)",
                  "needs vmscan events"),
        # copied raw (common.bpf.c tp_raw_capture), decoded with the format tracefs gives at run time
        ProbeSpec("oom_kill", "oom:mark_victim", "reclaim.bpf.c",
                  "OOM kills, host and memcg: the victim, its RSS, the requests it ended or shared a cgroup with",
                  "needs CONFIG_TRACEPOINTS (the oom events)", kind="tracepoint_raw",
                  absent="kernel has no oom:mark_victim (a 4.x kernel's tracepoint; needs CONFIG_TRACEPOINTS)"),
    ),
)
