"""The HTTP records of bpf/http.bpf.c (ring buffer http_events), decoded from their structs."""

from __future__ import annotations

from dataclasses import dataclass

from ..core import records as R
from ..core.decode import Counters, DecodeError, Header, Route, counters_from


@dataclass(frozen=True)
class HttpBegin:
    hdr: Header  # the thread that read the request head
    conn_id: int
    seq: int
    group: int  # the serving group's cgroup id, 0 if none could be kept
    fd: int
    head: bytes  # the request head's first bytes, untrusted
    thread: Counters
    proc: Counters
    grp: Counters


@dataclass(frozen=True)
class HttpEnd:
    hdr: Header  # the thread that ended it
    conn_id: int
    seq: int
    begin_ns: int
    written: int  # response bytes written
    group: int
    fd: int
    begin_tid: int
    status: int  # 0: no response head seen
    reason: str  # complete | next_request | closed
    mode: str  # length | chunked | unknown
    thread: Counters
    proc: Counters
    grp: Counters


def build_begin(rec: R.EvHttpBegin, hdr: Header) -> HttpBegin:
    if rec.head_len > len(rec.head):
        raise DecodeError("bad_field", f"http head length {rec.head_len}")
    return HttpBegin(hdr, rec.conn_id, rec.seq, rec.group, rec.fd, bytes(rec.head[:rec.head_len]),
                     counters_from(rec.thread), counters_from(rec.proc), counters_from(rec.grp))


def build_end(rec: R.EvHttpEnd, hdr: Header) -> HttpEnd:
    reason, mode = R.HTTP_END_REASONS.get(rec.reason), R.HTTP_MODES.get(rec.mode)
    if reason is None or mode is None:
        raise DecodeError("bad_field", f"http end reason {rec.reason} mode {rec.mode}")
    return HttpEnd(hdr, rec.conn_id, rec.seq, rec.begin_ns, rec.written, rec.group, rec.fd, rec.begin_tid,
                   rec.status, reason, mode, counters_from(rec.thread), counters_from(rec.proc),
                   counters_from(rec.grp))


DECODERS = {
    R.C["MCP_EV_HTTP_BEGIN"]: Route(R.EvHttpBegin, build_begin),
    R.C["MCP_EV_HTTP_END"]: Route(R.EvHttpEnd, build_end),
}
