"""Python mirror of the BPF headers (bpf/*.h): constants read from the headers themselves, the
shared structs as ctypes (each capability mirrors its own records beside its decoder).

A header is the one place a record's layout is defined. Constants (#define and enum values) of every
header are parsed at import, so they cannot disagree; struct layouts are mirrored and checked against
the C compiler's own sizeof/offsetof by tests/core/test_layout.py.
"""

from __future__ import annotations

import ctypes
import re
from importlib import resources
from types import MappingProxyType



def bpf_source_dir() -> str:
    """Directory holding the BPF C sources (package data of mcp_hostagent.bpf)."""
    return str(resources.files("mcp_hostagent.bpf"))


def _read_headers() -> str:
    d = resources.files("mcp_hostagent.bpf")
    return "\n".join(f.read_text() for f in sorted(d.iterdir(), key=lambda f: f.name) if f.name.endswith(".h"))


def parse_constants(text: str) -> dict[str, int]:
    """`#define NAME <int>` lines and `enum { NAME = <int>, NEXT, ... }` members."""
    out: dict[str, int] = {}
    for m in re.finditer(r"^#define\s+(MCP_\w+)\s+(0x[0-9a-fA-F]+|\d+)U?\b", text, re.M):
        out[m.group(1)] = int(m.group(2), 0)
    for body in re.findall(r"enum\s+\w+\s*\{(.*?)\};", text, re.S):
        value = -1
        for item in re.sub(r"/\*.*?\*/", "", body, flags=re.S).split(","):
            item = item.strip()
            if not item:
                continue
            name, _, expr = item.partition("=")
            value = int(expr.strip(), 0) if expr.strip() else value + 1
            out[name.strip()] = value
    return out


C = MappingProxyType(parse_constants(_read_headers()))

u8, u16, u32, u64 = ctypes.c_uint8, ctypes.c_uint16, ctypes.c_uint32, ctypes.c_uint64


class Mark(ctypes.Structure):
    _fields_ = [
        ("magic", u32),
        ("version", u16),
        ("op", u16),
        ("request_id", u64),
        ("traceparent", ctypes.c_char * C["MCP_TRACEPARENT_LEN"]),
    ]


class Counters(ctypes.Structure):
    _fields_ = [(name, u64) for name in (
        "faults", "vcsw", "ivcsw", "offcpu_ns",
        "direct_reclaims", "direct_reclaim_ns", "memcg_reclaims", "memcg_reclaim_ns", "reclaimed_pages",
        "kswapd_wakeups",
        "cu_launch", "cu_launch_ptsz", "cu_launch_ex", "cu_launch_ex_ptsz", "cu_graph_launch",
        "cu_ctx_ops", "cu_ctx_ns", "cu_syncs", "cu_sync_ns", "cu_allocs", "cu_alloc_ns", "cu_frees",
        "cu_free_ns", "nv_ioctls", "nv_ioctl_ns", "sampled",
        "offcpu_runnable_ns", "wakeup_wait_ns", "wakeups", "cu_alloc_oom",
        "oncpu_ns", "oncpu_homed_ns", "oncpu_remote_ns", "pagecache_added_bytes",
    )]


class ReqState(ctypes.Structure):
    _fields_ = [("request_id", u64), ("begin_ns", u64), ("tgid", u32), ("flags", u32), ("c", Counters)]


class TgidState(ctypes.Structure):
    _fields_ = [("open", u32), ("window_begins", u32), ("window_start_ns", u64), ("uid", u32), ("exempt", u32),
                ("cgroup_id", u64)]


class OwnerKey(ctypes.Structure):
    _fields_ = [("kind", u32), ("pad", u32), ("id", u64)]


class Budget(ctypes.Structure):
    _fields_ = [("window_start_ns", u64), ("window_begins", u32), ("open", u32), ("procs", u32),
                ("prev_begins", u32)]


class Offcpu(ctypes.Structure):
    _fields_ = [("ts_ns", u64), ("tgid", u32), ("runnable", u32), ("group", u64), ("thread", u32), ("pad", u32),
                ("woken_ns", u64)]


class Hdr(ctypes.Structure):
    _fields_ = [
        ("type", u16),
        ("size", u16),
        ("tgid", u32),
        ("tid", u32),
        ("cpu", u32),
        ("ts_ns", u64),
        ("cgroup_id", u64),
        ("comm", ctypes.c_char * 16),
    ]


class EvReqBegin(ctypes.Structure):
    _fields_ = [("h", Hdr), ("request_id", u64), ("traceparent", ctypes.c_char * C["MCP_TRACEPARENT_LEN"])]


class EvReqEnd(ctypes.Structure):
    _fields_ = [
        ("h", Hdr),
        ("request_id", u64),
        ("begin_ns", u64),
        ("reason", u32),
        ("pad", u32),
        ("c", Counters),
    ]


class EvProcExit(ctypes.Structure):
    _fields_ = [("h", Hdr), ("c", Counters)]


class EvReclaimStall(ctypes.Structure):
    _fields_ = [("h", Hdr), ("begin_ns", u64), ("nr_reclaimed", u64), ("gfp_flags", u64), ("kind", u32),
                ("order", ctypes.c_int32), ("request_id", u64)]


class EvKswapd(ctypes.Structure):
    _fields_ = [("h", Hdr), ("nid", u32), ("awake", u32), ("order", ctypes.c_int32), ("pad", u32)]


class ReclaimStart(ctypes.Structure):
    _fields_ = [("ts_ns", u64), ("gfp_flags", u64), ("order", ctypes.c_int32), ("kind", u32)]


# C struct name -> ctypes mirror; tests/core/test_layout.py walks this table.
STRUCTS = {
    "mcp_mark": Mark,
    "mcp_counters": Counters,
    "mcp_req_state": ReqState,
    "mcp_tgid_state": TgidState,
    "mcp_owner_key": OwnerKey,
    "mcp_budget": Budget,
    "mcp_offcpu": Offcpu,
    "mcp_hdr": Hdr,
    "mcp_ev_req_begin": EvReqBegin,
    "mcp_ev_req_end": EvReqEnd,
    "mcp_ev_proc_exit": EvProcExit,
    "mcp_ev_reclaim_stall": EvReclaimStall,
    "mcp_ev_kswapd": EvKswapd,
    "mcp_reclaim_start": ReclaimStart,
}

RECLAIM_KINDS = {C["MCP_RECLAIM_DIRECT"]: "direct", C["MCP_RECLAIM_MEMCG"]: "memcg"}

END_REASONS = {
    C["MCP_END_MARKED"]: "marked",
    C["MCP_END_SUPERSEDED"]: "superseded",
    C["MCP_END_THREAD_EXIT"]: "thread_exit",
    C["MCP_END_ID_MISMATCH"]: "id_mismatch",
}

# enum mcp_stat index -> metric label; the order is the header's.
KERNEL_STATS = {
    value: name[len("MCP_STAT_"):].lower()
    for name, value in C.items()
    if name.startswith("MCP_STAT_") and name != "MCP_STAT_MAX"
}
# Stats that count activity, not a record lost or refused: kept out of hostagent.agent.records.rejected.
ACTIVITY_STATS = frozenset({"rb_lost", "rb_req_lost", "rb_http_lost", "cu_launch_hits", "cu_auto_watch",
                            "switch_in_unseen"})


# ---- CUDA driver calls and NVIDIA ioctls (bpf/cuda.bpf.c, agent/cuda/capability.py) ----
class CuPendKey(ctypes.Structure):
    _fields_ = [("tid", u32), ("family", u32)]


class CuPend(ctypes.Structure):
    _fields_ = [("ts_ns", u64), ("kind", u32), ("pad", u32)]


class CuThread(ctypes.Structure):
    _fields_ = [("step_begin_ns", u64), ("tgid", u32), ("pad", u32), ("c", Counters)]


class HistKey(ctypes.Structure):
    _fields_ = [("tgid", u32), ("kind", u16), ("slot", u16)]


class NvFdKey(ctypes.Structure):
    _fields_ = [("tgid", u32), ("fd", u32)]


class NvIoctlStart(ctypes.Structure):
    _fields_ = [("ts_ns", u64), ("cmd", u32), ("dev", u32)]


class NvCmdKey(ctypes.Structure):
    _fields_ = [("tgid", u32), ("cmd", u32), ("dev", u32), ("pad", u32)]


class NvCmdVal(ctypes.Structure):
    _fields_ = [("count", u64), ("ns", u64)]


class EvGpuStep(ctypes.Structure):
    _fields_ = [("h", Hdr), ("begin_ns", u64), ("sync_ns", u64), ("sync_kind", u32), ("pad", u32), ("c", Counters)]


STRUCTS.update({
    "mcp_cu_pend_key": CuPendKey,
    "mcp_cu_pend": CuPend,
    "mcp_cu_thread": CuThread,
    "mcp_hist_key": HistKey,
    "mcp_nv_fd_key": NvFdKey,
    "mcp_nv_ioctl_start": NvIoctlStart,
    "mcp_nv_cmd_key": NvCmdKey,
    "mcp_nv_cmd_val": NvCmdVal,
    "mcp_ev_gpu_step": EvGpuStep,
})

SYNC_KINDS = {C["MCP_CU_SYNC_STREAM"]: "stream", C["MCP_CU_SYNC_CTX"]: "ctx", C["MCP_CU_SYNC_EVENT"]: "event"}
HIST_KINDS = {C["MCP_HIST_CTX"]: "ctx", C["MCP_HIST_SYNC"]: "sync", C["MCP_HIST_IOCTL"]: "ioctl",
              C["MCP_HIST_ALLOC"]: "alloc", C["MCP_HIST_FREE"]: "free"}


# ---- GPU and PCIe health tracepoints (bpf/health.bpf.c, agent/gpuhealth/health_records.py) ----
class EvTpRaw(ctypes.Structure):
    _fields_ = [("h", Hdr), ("kind", u32), ("len", u32), ("data", u8 * C["MCP_TP_RAW_LEN"])]


STRUCTS["mcp_ev_tp_raw"] = EvTpRaw


# ---- zero-code HTTP/1.1 requests (bpf/http.bpf.c, agent/http) ----
class HttpArgs(ctypes.Structure):
    _fields_ = [("buf", u64), ("count", u64), ("fd", u32), ("sys", u32), ("sk", u64), ("sock", u32), ("pad", u32)]


class HttpConnKey(ctypes.Structure):
    _fields_ = [("tgid", u32), ("fd", u32)]


class HttpDir(ctypes.Structure):
    _fields_ = [("left", u64), ("state", u8), ("midline", u8), ("carry_len", u8), ("flags", u8), ("lines", u16),
                ("status", u16), ("clv", u8 * 24), ("carry", u8 * C["MCP_HTTP_CARRY"])]


class HttpReq(ctypes.Structure):
    _fields_ = [("begin_ns", u64), ("seq", u64), ("group", u64), ("tid", u32), ("head_only", u8), ("tunnel", u8),
                ("ghost", u8), ("pad", u8)]


class HttpConn(ctypes.Structure):
    _fields_ = [("sk", u64), ("conn_id", u64), ("gen", u64), ("seq", u64), ("written", u64), ("interim", u64),
                ("rx_seq", u32), ("tx_seq", u32), ("tx_mode", u8), ("pad", u8 * 7), ("rx", HttpDir), ("tx", HttpDir),
                ("q", HttpReq * C["MCP_HTTP_PIPELINE"])]


class HttpPend(ctypes.Structure):
    _fields_ = [("sk", u64), ("first_ns", u64), ("len", u32), ("reads", u32), ("flags", u32), ("pad", u32),
                ("rx", HttpDir), ("head", u8 * (2 * C["MCP_HTTP_HEAD_LEN"]))]


class HttpProc(ctypes.Structure):
    _fields_ = [("gen", u64), ("window_start_ns", u64), ("cgroup_id", u64), ("uid", u32), ("exempt", u32),
                ("begins", u32), ("conns", u32)]


class HttpBudget(ctypes.Structure):
    _fields_ = [("window_start_ns", u64), ("begins", u32), ("prev_begins", u32), ("conns", u32), ("pad", u32),
                ("begun", u64)]


class EvHttpBegin(ctypes.Structure):
    _fields_ = [("h", Hdr), ("conn_id", u64), ("seq", u64), ("group", u64), ("first_ns", u64), ("fd", u32),
                ("head_len", u32), ("reads", u32), ("flags", u32), ("owner_uid", u32), ("exempt", u32),
                ("owner_cgroup", u64), ("thread", Counters), ("proc", Counters), ("grp", Counters),
                ("head", u8 * C["MCP_HTTP_HEAD_LEN"])]


class EvHttpEnd(ctypes.Structure):
    _fields_ = [("h", Hdr), ("conn_id", u64), ("seq", u64), ("begin_ns", u64), ("written", u64), ("interim", u64),
                ("group", u64), ("fd", u32), ("begin_tid", u32), ("status", u16), ("reason", u8), ("mode", u8),
                ("pad", u32), ("thread", Counters), ("proc", Counters), ("grp", Counters)]


STRUCTS.update({
    "mcp_http_args": HttpArgs,
    "mcp_http_conn_key": HttpConnKey,
    "mcp_http_dir": HttpDir,
    "mcp_http_req": HttpReq,
    "mcp_http_conn": HttpConn,
    "mcp_http_pend": HttpPend,
    "mcp_http_proc": HttpProc,
    "mcp_http_budget": HttpBudget,
    "mcp_ev_http_begin": EvHttpBegin,
    "mcp_ev_http_end": EvHttpEnd,
})

HTTP_END_REASONS = {C["MCP_HTTP_END_COMPLETE"]: "complete", C["MCP_HTTP_END_CLOSE"]: "closed",
                    C["MCP_HTTP_END_MARKED"]: "marked"}
HTTP_MODES = {C["MCP_HTTP_MODE_UNKNOWN"]: "until_close", C["MCP_HTTP_MODE_LENGTH"]: "length",
              C["MCP_HTTP_MODE_CHUNKED"]: "chunked"}
