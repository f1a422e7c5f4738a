"""bpf/reclaim.h mirrored (constants read from it, structs as ctypes: tests/core/test_layout.py), the
reclaim records of bpf/reclaim.bpf.c (ring buffer events) decoded from their structs, and the settings
the program is compiled with (bpf_settings: the loader reads them before the compile starts, without
importing the capability's pipeline)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from ..core import records as R
from ..core.decode import DecodeError, Header, Route
from ..core.records import Hdr, u32, u64

C = R.header_constants("reclaim.h")

# struct mcp_counters field -> request span attribute (docs/TELEMETRY.md): what reclaim.bpf.c counts
COUNTERS = {
    "direct_reclaims": "hostagent.reclaim.direct.count",
    "direct_reclaim_ns": "hostagent.reclaim.direct.stall.time",
    "memcg_reclaims": "hostagent.reclaim.memcg.count",
    "memcg_reclaim_ns": "hostagent.reclaim.memcg.stall.time",
    "reclaimed_pages": "hostagent.reclaim.pages",
    "kswapd_wakeups": "hostagent.reclaim.kswapd_wakeups",
}


def bpf_settings(cfg) -> dict[str, int]:
    """reclaim.bpf.c's compile-time settings: stalls at least this long travel as records."""
    return {"MCP_STALL_THRESHOLD_NS": int(cfg.reclaim_stall_threshold_ms * 1e6)}


class EvReclaimStall(ctypes.Structure):
    _fields_ = [("h", Hdr), ("begin_ns", u64), ("nr_reclaimed", u64), ("gfp_flags", u64), ("kind", u32),
                ("order", ctypes.c_int32), ("request_id", u64)]


class EvKswapd(ctypes.Structure):
    _fields_ = [("h", Hdr), ("nid", u32), ("awake", u32), ("order", ctypes.c_int32), ("pad", u32)]


class ReclaimStart(ctypes.Structure):
    _fields_ = [("ts_ns", u64), ("gfp_flags", u64), ("order", ctypes.c_int32), ("kind", u32)]


STRUCTS = {"mcp_ev_reclaim_stall": EvReclaimStall, "mcp_ev_kswapd": EvKswapd, "mcp_reclaim_start": ReclaimStart}
RECLAIM_KINDS = {C["MCP_RECLAIM_DIRECT"]: "direct", C["MCP_RECLAIM_MEMCG"]: "memcg"}


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


def build_stall(rec: EvReclaimStall, hdr: Header) -> ReclaimStall:
    kind = RECLAIM_KINDS.get(rec.kind)
    if kind is None:
        raise DecodeError("bad_field", f"reclaim kind {rec.kind}")
    return ReclaimStall(hdr, kind, rec.begin_ns, rec.nr_reclaimed, rec.gfp_flags, rec.order, rec.request_id)


def build_kswapd(rec: EvKswapd, hdr: Header) -> Kswapd:
    return Kswapd(hdr, rec.nid, bool(rec.awake), rec.order)


# record type -> its struct and builder (the capability adds the handlers)
DECODERS = {
    C["MCP_EV_RECLAIM_STALL"]: Route(EvReclaimStall, build_stall),
    C["MCP_EV_KSWAPD"]: Route(EvKswapd, build_kswapd),
}
