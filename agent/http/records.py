"""The HTTP records of bpf/http.bpf.c (ring buffer http_events), decoded from their structs, and the
settings that program is compiled with (bpf_settings: read by the loader before the compile, without
importing the capability's pipeline)."""

from __future__ import annotations

from dataclasses import dataclass

from ..core import records as R
from ..core.decode import Counters, DecodeError, Header, Route, counters_from
from ..core.kernel import tracepoint_exists

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


def build_begin(rec: R.EvHttpBegin, hdr: Header) -> HttpBegin:
    if rec.head_len >= len(rec.head):
        raise DecodeError("bad_field", f"http head length {rec.head_len}")
    if rec.first_ns > hdr.ts_ns:
        raise DecodeError("bad_field", "http head began after it ended")
    owners = () if rec.exempt else ((R.C["MCP_OWNER_UID"], rec.owner_uid), (R.C["MCP_OWNER_CGROUP"], rec.owner_cgroup))
    return HttpBegin(hdr, rec.conn_id, rec.seq, rec.group, rec.first_ns, rec.fd, rec.reads,
                     bool(rec.flags & R.C["MCP_HTTP_BEGIN_TRUNCATED"]), bool(rec.flags & R.C["MCP_HTTP_BEGIN_PARTIAL"]),
                     owners, bytes(rec.head[:rec.head_len]), counters_from(rec.thread), counters_from(rec.proc),
                     counters_from(rec.grp))


def build_end(rec: R.EvHttpEnd, hdr: Header) -> HttpEnd:
    reason, mode = R.HTTP_END_REASONS.get(rec.reason), R.HTTP_MODES.get(rec.mode)
    if reason is None or mode is None:
        raise DecodeError("bad_field", f"http end reason {rec.reason} mode {rec.mode}")
    if rec.interim > rec.written:
        raise DecodeError("bad_field", f"http interim {rec.interim} > written {rec.written}")
    return HttpEnd(hdr, rec.conn_id, rec.seq, rec.begin_ns, rec.written, rec.interim, rec.group, rec.fd,
                   rec.begin_tid, rec.status, reason, mode, counters_from(rec.thread), counters_from(rec.proc),
                   counters_from(rec.grp))


DECODERS = {
    R.C["MCP_EV_HTTP_BEGIN"]: Route(R.EvHttpBegin, build_begin),
    R.C["MCP_EV_HTTP_END"]: Route(R.EvHttpEnd, build_end),
}
