"""The request records of bpf/requests.bpf.c (ring buffer req_events), decoded from their structs."""

from __future__ import annotations

from dataclasses import dataclass

from ..core import records as R
from ..core.decode import Counters, DecodeError, Header, Route, counters_from


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
