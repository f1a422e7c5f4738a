"""Ring-buffer bytes -> frozen typed records. Pure functions, no I/O.

A record that is too short, has an unknown type, or whose header size disagrees with its type's
struct raises DecodeError; the pipeline counts it (mcp.agent.records.rejected) and skips it.
"""

from __future__ import annotations

import ctypes
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


@dataclass(frozen=True)
class Counters:
    faults: int = 0
    vcsw: int = 0
    ivcsw: int = 0
    offcpu_ns: int = 0

    def __add__(self, other: "Counters") -> "Counters":
        return Counters(*(a + b for a, b in zip(self.astuple(), other.astuple())))

    def astuple(self) -> tuple[int, int, int, int]:
        return (self.faults, self.vcsw, self.ivcsw, self.offcpu_ns)


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




def counters_from(c: R.Counters) -> Counters:
    return Counters(c.faults, c.vcsw, c.ivcsw, c.offcpu_ns)


def _header(h: R.Hdr) -> Header:
    return Header(h.type, h.tgid, h.tid, h.cpu, h.ts_ns, h.cgroup_id, bytes(h.comm).split(b"\0", 1)[0])


def decode(raw: bytes) -> "ReqBegin | ReqEnd | ProcExit":
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
    return ProcExit(hdr, counters_from(rec.c))
