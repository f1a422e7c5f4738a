"""The request records of bpf/requests.bpf.c (ring buffer req_events), decoded from their structs,
and the settings the program is compiled with (bpf_settings: the loader reads them before the
compile starts, without importing the capability's pipeline)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..core import kernel, records as R, tracefs
from ..core.decode import Counters, DecodeError, Header, Route, counters_from
from . import owners


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


def build_begin(rec: R.EvReqBegin, hdr: Header) -> ReqBegin:
    return ReqBegin(hdr, rec.request_id, bytes(rec.traceparent).split(b"\0", 1)[0])


def build_end(rec: R.EvReqEnd, hdr: Header) -> ReqEnd:
    reason = R.END_REASONS.get(rec.reason)
    if reason is None:
        raise DecodeError("bad_field", f"end reason {rec.reason}")
    return ReqEnd(hdr, rec.request_id, rec.begin_ns, reason, counters_from(rec.c))


def build_exit(rec: R.EvProcExit, hdr: Header) -> ProcExit:
    return ProcExit(hdr, counters_from(rec.c))


# record type -> its struct and builder (the capability adds the handlers)
DECODERS = {
    R.C["MCP_EV_REQ_BEGIN"]: Route(R.EvReqBegin, build_begin),
    R.C["MCP_EV_REQ_END"]: Route(R.EvReqEnd, build_end),
    R.C["MCP_EV_PROC_EXIT"]: Route(R.EvProcExit, build_exit),
}
