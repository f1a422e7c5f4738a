"""bpf/requests.h mirrored (constants read from it, structs as ctypes: tests/core/test_layout.py), the
request records of bpf/requests.bpf.c (ring buffer req_events) decoded from their structs, and the
settings the program is compiled with (bpf_settings: the loader reads them before the compile starts,
without importing the capability's pipeline)."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from ..core import kernel, records as R, tracefs
from ..core.decode import Counters, DecodeError, Header, Route, counters_from
from ..core.records import Hdr, u16, u32, u64
from . import owners

C = R.header_constants("requests.h")

# struct mcp_counters field -> request span attribute (docs/TELEMETRY.md): the ones requests.bpf.c's
# probes count. The foundation's four are shown even at 0.
COUNTERS = {
    "faults": "hostagent.faults.user",
    "vcsw": "hostagent.context_switches.voluntary",
    "ivcsw": "hostagent.context_switches.involuntary",
    "offcpu_ns": "hostagent.offcpu.time",
    "offcpu_runnable_ns": "hostagent.offcpu.runnable.time",
    "wakeup_wait_ns": "hostagent.offcpu.wakeup_wait.time",
    "wakeups": "hostagent.offcpu.wakeups",
    "oncpu_ns": "hostagent.oncpu.time",
    "pagecache_added_bytes": "hostagent.page_cache.added.size",
}
ALWAYS_SHOWN = frozenset({"faults", "vcsw", "ivcsw", "offcpu_ns"})


class Mark(ctypes.Structure):
    _fields_ = [
        ("magic", u32),
        ("version", u16),
        ("op", u16),
        ("request_id", u64),
        ("traceparent", ctypes.c_char * C["MCP_TRACEPARENT_LEN"]),
    ]


class ReqState(ctypes.Structure):
    _fields_ = [("request_id", u64), ("begin_ns", u64), ("tgid", u32), ("flags", u32), ("c", R.Counters)]


class TgidState(ctypes.Structure):
    _fields_ = [("open", u32), ("window_begins", u32), ("window_start_ns", u64), ("uid", u32), ("exempt", u32),
                ("cgroup_id", u64)]


class Budget(ctypes.Structure):
    _fields_ = [("window_start_ns", u64), ("window_begins", u32), ("open", u32), ("procs", u32),
                ("prev_begins", u32)]


class Offcpu(ctypes.Structure):
    _fields_ = [("ts_ns", u64), ("tgid", u32), ("runnable", u32), ("group", u64), ("thread", u32), ("pad", u32),
                ("woken_ns", u64)]


class CpuRun(ctypes.Structure):
    _fields_ = [("ts_ns", u64), ("tid", u32), ("pad", u32), ("unseen_from", u64)]


class Slice(ctypes.Structure):
    _fields_ = [("ns", u64), ("homed", u64), ("remote", u64)]


class EvReqBegin(ctypes.Structure):
    _fields_ = [("h", Hdr), ("request_id", u64), ("traceparent", ctypes.c_char * C["MCP_TRACEPARENT_LEN"])]


class EvReqEnd(ctypes.Structure):
    _fields_ = [("h", Hdr), ("request_id", u64), ("begin_ns", u64), ("reason", u32), ("pad", u32), ("c", R.Counters)]


class EvProcExit(ctypes.Structure):
    _fields_ = [("h", Hdr), ("c", R.Counters)]


STRUCTS = {"mcp_mark": Mark, "mcp_req_state": ReqState, "mcp_tgid_state": TgidState, "mcp_budget": Budget,
           "mcp_offcpu": Offcpu, "mcp_cpu_run": CpuRun, "mcp_slice": Slice, "mcp_ev_req_begin": EvReqBegin, "mcp_ev_req_end": EvReqEnd,
           "mcp_ev_proc_exit": EvProcExit}

END_REASONS = {
    C["MCP_END_MARKED"]: "marked",
    C["MCP_END_SUPERSEDED"]: "superseded",
    C["MCP_END_THREAD_EXIT"]: "thread_exit",
    C["MCP_END_ID_MISMATCH"]: "id_mismatch",
}


def bpf_settings(cfg) -> dict[str, int]:
    """requests.bpf.c's compile-time settings: per-process and per-owner limits."""
    return {"MCP_MAX_OPEN_PER_PID": cfg.requests_max_open_per_pid, "MCP_GROUP_TREE": cfg.requests_group == "tree",
            "MCP_MAX_BEGINS_PER_S": cfg.requests_max_begins_per_s_per_pid, **owners.bpf_settings(cfg),
            "MCP_PAGE_SIZE": os.sysconf("SC_PAGE_SIZE"), "MCP_FILEMAP_ORDER": filemap_has_order()}


def filemap_has_order() -> bool:
    """Whether mm_filemap_add_to_page_cache says its folio's order (newer kernels; older ones add one
    page each): bcc builds the record's struct from the format at compile time, so the field is used
    only where the format has it."""
    name = "filemap/mm_filemap_add_to_page_cache"
    fmt = tracefs.load_formats(kernel.TRACEFS, [name])[name]
    return isinstance(fmt, tracefs.TracepointFormat) and any(f.name == "order" for f in fmt.fields)


@dataclass(frozen=True)
class ReqBegin:
    hdr: Header
    request_id: int
    traceparent: bytes  # raw bytes up to the first NUL, unvalidated


@dataclass(frozen=True)
class ReqEnd:
    hdr: Header
    request_id: int
    begin_ns: int
    reason: str
    counters: Counters


@dataclass(frozen=True)
class ProcExit:
    hdr: Header
    counters: Counters


def build_begin(rec: EvReqBegin, hdr: Header) -> ReqBegin:
    return ReqBegin(hdr, rec.request_id, bytes(rec.traceparent).split(b"\0", 1)[0])


def build_end(rec: EvReqEnd, hdr: Header) -> ReqEnd:
    reason = END_REASONS.get(rec.reason)
    if reason is None:
        raise DecodeError("bad_field", f"end reason {rec.reason}")
    return ReqEnd(hdr, rec.request_id, rec.begin_ns, reason, counters_from(rec.c))


def build_exit(rec: EvProcExit, hdr: Header) -> ProcExit:
    return ProcExit(hdr, counters_from(rec.c))


# record type -> its struct and builder (the capability adds the handlers)
DECODERS = {
    C["MCP_EV_REQ_BEGIN"]: Route(EvReqBegin, build_begin),
    C["MCP_EV_REQ_END"]: Route(EvReqEnd, build_end),
    C["MCP_EV_PROC_EXIT"]: Route(EvProcExit, build_exit),
}
