"""Ring-buffer bytes -> frozen typed records, by a table of record types. Pure functions, no I/O.

Every record starts with struct mcp_hdr (bpf/mcp_records.h). Each capability registers, per record
type it owns, the struct that mirrors it and a function building its record (Route). A record that is
too short, has a type nobody registered, or whose header size disagrees with its struct raises
DecodeError; the agent counts it (hostagent.agent.records.rejected) and skips it.
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass
from typing import Callable

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
class TpRaw:
    """The first bytes of a tracepoint's record, copied by a "tracepoint_raw" probe (bpf/health.bpf.c);
    decoded in user space with the tracepoint's run-time format (core/tracefs.py)."""

    hdr: Header  # the task that ran the tracepoint; hdr.ts_ns is when
    kind: int  # enum mcp_tp_kind
    data: bytes  # the record from its common header on; past the record's own end, stale bytes


def counters_from(c: R.Counters) -> Counters:
    return Counters(*(getattr(c, f) for f in COUNTER_FIELDS))


def header(h: R.Hdr) -> Header:
    return Header(h.type, h.tgid, h.tid, h.cpu, h.ts_ns, h.cgroup_id, bytes(h.comm).split(b"\0", 1)[0])


@dataclass(frozen=True)
class Route:
    """One record type: its ctypes mirror, the function building the record from it (DecodeError on a
    bad field) and the handlers it goes to, in order."""

    struct: type
    build: Callable  # (struct instance, Header) -> record
    handlers: tuple[Callable, ...] = ()

    def with_handlers(self, *more: Callable) -> "Route":
        return Route(self.struct, self.build, self.handlers + more)


def decode(raw: bytes, routes: dict[int, Route]):
    """-> (record, its route)."""
    hsize = ctypes.sizeof(R.Hdr)
    if len(raw) < hsize:
        raise DecodeError("short", f"{len(raw)} bytes, header needs {hsize}")
    h = R.Hdr.from_buffer_copy(raw[:hsize])
    route = routes.get(h.type)
    if route is None:
        raise DecodeError("unknown_type", f"type {h.type}")
    size = ctypes.sizeof(route.struct)
    if h.size != size or len(raw) < size:
        raise DecodeError("bad_size", f"type {h.type}: header says {h.size}, record {len(raw)}, layout {size}")
    rec = route.struct.from_buffer_copy(raw[:size])
    return route.build(rec, header(rec.h)), route


def build_tp_raw(rec: R.EvTpRaw, hdr: Header) -> TpRaw:
    if not 0 < rec.len <= len(rec.data):
        raise DecodeError("bad_field", f"tracepoint record length {rec.len}")
    return TpRaw(hdr, rec.kind, bytes(rec.data[:rec.len]))


# the raw tracepoint copies of "tracepoint_raw" probes; the capability that owns each kind decodes it
TP_RAW = {R.C["MCP_EV_TP_RAW"]: Route(R.EvTpRaw, build_tp_raw)}
