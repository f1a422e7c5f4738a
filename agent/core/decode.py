"""Ring-buffer bytes -> frozen typed records. Pure functions, no I/O.

A record that is too short, has an unknown type, or whose header size disagrees with its type's
struct raises DecodeError; the pipeline counts it (mcp.agent.records.rejected) and skips it.
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass

from . import records as R


class DecodeError(ValueError):
    """A ring-buffer record that does not match any layout in bpf/mcp_records.h."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class Header:
    type: int
    tgid: int
    tid: int
    cpu: int
    ts_ns: int  # kernel CLOCK_MONOTONIC
    cgroup_id: int
    comm: bytes  # raw, untrusted: sanitise before display (identity.sanitize_text)


COUNTER_FIELDS = tuple(name for name, _ in R.Counters._fields_)


class _CountersOps:
    def __add__(self, other):
        return type(self)(*(a + b for a, b in zip(self.astuple(), other.astuple())))

    def __sub__(self, other):
        return type(self)(*(a - b for a, b in zip(self.astuple(), other.astuple())))

    def astuple(self) -> tuple[int, ...]:
        return tuple(getattr(self, f) for f in COUNTER_FIELDS)


# Fields are those of struct mcp_counters in bpf/mcp_records.h, in order, all defaulting to 0.
Counters = dataclasses.make_dataclass(
    "Counters", [(f, int, dataclasses.field(default=0)) for f in COUNTER_FIELDS], bases=(_CountersOps,),
    frozen=True)
Counters.__module__ = __name__


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




@dataclass(frozen=True)
class ReclaimStall:
    hdr: Header  # the stalled thread; hdr.ts_ns is the end of the stall
    kind: str  # "direct" | "memcg"
    begin_ns: int
    nr_reclaimed: int
    gfp_flags: int
    order: int
    request_id: int  # the thread's open request, 0 if none

    @property
    def stall_ns(self) -> int:
        return self.hdr.ts_ns - self.begin_ns


@dataclass(frozen=True)
class Kswapd:
    hdr: Header
    nid: int
    awake: bool
    order: int


@dataclass(frozen=True)
class TpRaw:
    """The first bytes of a health tracepoint's record (bpf/health.bpf.c); agent/tphealth.py decodes
    them with the tracepoint's format."""

    hdr: Header  # the task that ran the tracepoint; hdr.ts_ns is when
    kind: int  # enum mcp_tp_kind
    data: bytes  # the record from its common header on; past the record's own end, stale bytes


def counters_from(c: R.Counters) -> Counters:
    return Counters(*(getattr(c, f) for f in COUNTER_FIELDS))


def _header(h: R.Hdr) -> Header:
    return Header(h.type, h.tgid, h.tid, h.cpu, h.ts_ns, h.cgroup_id, bytes(h.comm).split(b"\0", 1)[0])


def decode(raw: bytes) -> "ReqBegin | ReqEnd | ProcExit | ReclaimStall | Kswapd | TpRaw":
    hsize = ctypes.sizeof(R.Hdr)
    if len(raw) < hsize:
        raise DecodeError("short", f"{len(raw)} bytes, header needs {hsize}")
    h = R.Hdr.from_buffer_copy(raw[:hsize])
    cls = R.EVENT_TYPES.get(h.type)
    if cls is None:
        raise DecodeError("unknown_type", f"type {h.type}")
    size = ctypes.sizeof(cls)
    if h.size != size or len(raw) < size:
        raise DecodeError("bad_size", f"type {h.type}: header says {h.size}, record {len(raw)}, layout {size}")
    rec = cls.from_buffer_copy(raw[:size])
    hdr = _header(rec.h)
    if cls is R.EvReqBegin:
        return ReqBegin(hdr, rec.request_id, bytes(rec.traceparent).split(b"\0", 1)[0])
    if cls is R.EvReqEnd:
        reason = R.END_REASONS.get(rec.reason)
        if reason is None:
            raise DecodeError("bad_field", f"end reason {rec.reason}")
        return ReqEnd(hdr, rec.request_id, rec.begin_ns, reason, counters_from(rec.c))
    if cls is R.EvReclaimStall:
        kind = R.RECLAIM_KINDS.get(rec.kind)
        if kind is None:
            raise DecodeError("bad_field", f"reclaim kind {rec.kind}")
        return ReclaimStall(hdr, kind, rec.begin_ns, rec.nr_reclaimed, rec.gfp_flags, rec.order, rec.request_id)
    if cls is R.EvKswapd:
        return Kswapd(hdr, rec.nid, bool(rec.awake), rec.order)
    if cls is R.EvTpRaw:
        if not 0 < rec.len <= len(rec.data):
            raise DecodeError("bad_field", f"tracepoint record length {rec.len}")
        return TpRaw(hdr, rec.kind, bytes(rec.data[:rec.len]))
    return ProcExit(hdr, counters_from(rec.c))
