"""bpf/http.h mirrored (constants read from it, structs as ctypes: tests/core/test_layout.py), the HTTP
records of bpf/http.bpf.c (ring buffer http_events) decoded from their structs, and the settings that
program is compiled with (bpf_settings: read by the loader before the compile, without importing the
capability's pipeline)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from ..core import records as R
from ..core.decode import Counters, DecodeError, Header, Route, counters_from
from ..core.kernel import tracepoint_exists
from ..core.records import Hdr, u8, u16, u32, u64

C = R.header_constants("http.h")

SOCK_TRACEPOINTS = (("sock", "sock_recv_length"), ("sock", "sock_send_length"))


def sock_tracepoints(cfg) -> bool:
    """Whether the kernel tells sockets apart for the HTTP probes (sock:sock_*_length, Linux 6.3+) and
    both probes are on: then a file's or pipe's bytes never reach user space. Without them user space
    checks each new connection's fd in /proc (agent/http/capability.py)."""
    disabled = set(cfg.probes_disable)
    return (not {"http_sock_recv", "http_sock_send"} & disabled
            and all(tracepoint_exists(c, e) for c, e in SOCK_TRACEPOINTS))


def bpf_settings(cfg) -> dict[str, int]:
    return {"MCP_HTTP_SOCK_TP": sock_tracepoints(cfg), "MCP_HTTP_CONNS_PER_OWNER": cfg.requests_http_conns_per_owner}


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
                ("owner_cgroup", u64), ("thread", R.Counters), ("proc", R.Counters), ("grp", R.Counters),
                ("head", u8 * C["MCP_HTTP_HEAD_LEN"])]


class EvHttpEnd(ctypes.Structure):
    _fields_ = [("h", Hdr), ("conn_id", u64), ("seq", u64), ("begin_ns", u64), ("written", u64), ("interim", u64),
                ("group", u64), ("fd", u32), ("begin_tid", u32), ("status", u16), ("reason", u8), ("mode", u8),
                ("pad", u32), ("thread", R.Counters), ("proc", R.Counters), ("grp", R.Counters)]


STRUCTS = {
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
}

HTTP_END_REASONS = {C["MCP_HTTP_END_COMPLETE"]: "complete", C["MCP_HTTP_END_CLOSE"]: "closed",
                    C["MCP_HTTP_END_MARKED"]: "marked"}
HTTP_MODES = {C["MCP_HTTP_MODE_UNKNOWN"]: "until_close", C["MCP_HTTP_MODE_LENGTH"]: "length",
              C["MCP_HTTP_MODE_CHUNKED"]: "chunked"}


@dataclass(frozen=True)
class HttpBegin:
    hdr: Header  # the thread that read the head's end
    conn_id: int
    seq: int
    group: int  # the serving group's key, 0 if none could be kept
    first_ns: int  # the head's first byte's read
    fd: int
    reads: int  # reads the head came in
    truncated: bool  # the head was longer than what was kept
    partial: bool  # the head's first bytes were not kept
    owners: tuple  # ((kind, id), ...): the owners it counts to in the kernel's pressure rule; () exempt
    head: bytes  # the request head's bytes, untrusted
    thread: Counters
    proc: Counters
    grp: Counters


@dataclass(frozen=True)
class HttpEnd:
    hdr: Header  # the thread that ended it
    conn_id: int
    seq: int
    begin_ns: int
    written: int  # response bytes written, 1xx responses included
    interim: int  # of which 1xx responses
    group: int
    fd: int
    begin_tid: int
    status: int  # 0: no response head seen
    reason: str  # complete | closed | marked
    mode: str  # length | chunked | until_close
    thread: Counters
    proc: Counters
    grp: Counters


def build_begin(rec: EvHttpBegin, hdr: Header) -> HttpBegin:
    if rec.head_len >= len(rec.head):
        raise DecodeError("bad_field", f"http head length {rec.head_len}")
    if rec.first_ns > hdr.ts_ns:
        raise DecodeError("bad_field", "http head began after it ended")
    owners = () if rec.exempt else ((C["MCP_OWNER_UID"], rec.owner_uid), (C["MCP_OWNER_CGROUP"], rec.owner_cgroup))
    return HttpBegin(hdr, rec.conn_id, rec.seq, rec.group, rec.first_ns, rec.fd, rec.reads,
                     bool(rec.flags & C["MCP_HTTP_BEGIN_TRUNCATED"]), bool(rec.flags & C["MCP_HTTP_BEGIN_PARTIAL"]),
                     owners, bytes(rec.head[:rec.head_len]), counters_from(rec.thread), counters_from(rec.proc),
                     counters_from(rec.grp))


def build_end(rec: EvHttpEnd, hdr: Header) -> HttpEnd:
    reason, mode = HTTP_END_REASONS.get(rec.reason), HTTP_MODES.get(rec.mode)
    if reason is None or mode is None:
        raise DecodeError("bad_field", f"http end reason {rec.reason} mode {rec.mode}")
    if rec.interim > rec.written:
        raise DecodeError("bad_field", f"http interim {rec.interim} > written {rec.written}")
    return HttpEnd(hdr, rec.conn_id, rec.seq, rec.begin_ns, rec.written, rec.interim, rec.group, rec.fd,
                   rec.begin_tid, rec.status, reason, mode, counters_from(rec.thread), counters_from(rec.proc),
                   counters_from(rec.grp))


DECODERS = {
    C["MCP_EV_HTTP_BEGIN"]: Route(EvHttpBegin, build_begin),
    C["MCP_EV_HTTP_END"]: Route(EvHttpEnd, build_end),
}
