"""The reclaim records of bpf/reclaim.bpf.c (ring buffer events), decoded from their structs,
and the settings the program is compiled with (bpf_settings: the loader reads them before the
compile starts, without importing the capability's pipeline)."""

from __future__ import annotations

from dataclasses import dataclass

from ..core import records as R
from ..core.decode import DecodeError, Header, Route


def bpf_settings(cfg) -> dict[str, int]:
    """reclaim.bpf.c's compile-time settings: stalls at least this long travel as records."""
    return {"MCP_STALL_THRESHOLD_NS": int(cfg.reclaim_stall_threshold_ms * 1e6)}


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


def build_stall(rec: R.EvReclaimStall, hdr: Header) -> ReclaimStall:
    kind = R.RECLAIM_KINDS.get(rec.kind)
    if kind is None:
        raise DecodeError("bad_field", f"reclaim kind {rec.kind}")
    return ReclaimStall(hdr, kind, rec.begin_ns, rec.nr_reclaimed, rec.gfp_flags, rec.order, rec.request_id)


def build_kswapd(rec: R.EvKswapd, hdr: Header) -> Kswapd:
    return Kswapd(hdr, rec.nid, bool(rec.awake), rec.order)


# record type -> its struct and builder (the capability adds the handlers)
DECODERS = {
    R.C["MCP_EV_RECLAIM_STALL"]: Route(R.EvReclaimStall, build_stall),
    R.C["MCP_EV_KSWAPD"]: Route(R.EvKswapd, build_kswapd),
}
