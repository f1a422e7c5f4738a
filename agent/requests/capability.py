"""Requests: the marked windows of serving threads (bpf/requests.bpf.c) -> the request path.

BEGIN/END/EXIT records are paired by the joiner (join.py) into FinishedRequests for the core's request
path (core/request.py: every capability's evidence, one span, the duration metric). Requests whose END
never comes are expired here from the kernel map. The kernel's pressure rule needs to know how far the
reader is behind: the records read from req_events are told back (req_flow[MCP_FLOW_CONSUMED]).
"""

from __future__ import annotations

import ctypes
import time

from ..core.capability import Capability, CapabilityError
from ..core.decode import counters_from
from . import owners, records, telemetry
from .join import RequestJoiner
from .records import C
from .section import RequestsSection

EXPIRY_SCAN_S = 5.0
# records read from req_events between updates of req_flow[CONSUMED] inside one poll (a map write)
REQ_READ_TELL_EVERY = 64


class Requests(Capability):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.idle_expiry_s = ctx.cfg.requests_idle_expiry_s
        self.joiner = RequestJoiner(ctx.health.rejected)  # one Counter for every user-space refusal
        self._allow = []
        self._next_expiry = 0.0
        self._read = self._told = 0  # records read from req_events; the count last written to the kernel

    def prepare(self) -> None:
        try:
            self._allow = owners.allowed_owners(self.ctx.cfg)
        except owners.OwnerError as e:
            raise CapabilityError(str(e)) from None

    def loaded(self) -> None:
        """Before any probe sees a marker: the maps exist from the load on."""
        owners.write_allow(self.ctx.bpf, self._allow)

    def provided(self) -> dict:
        return {"requests.tree_root": self.root_of}

    def root_of(self, tgid: int) -> int | None:
        """requests.group = tree: the root of the process tree tgid serves in, if any (map tree_root)."""
        v = self.ctx.bpf[b"tree_root"].get(ctypes.c_uint32(tgid))
        return None if v is None else v.value

    def routes(self) -> dict:
        handlers = {C["MCP_EV_REQ_BEGIN"]: (self.on_begin,), C["MCP_EV_REQ_END"]: (self.on_end,),
                    C["MCP_EV_PROC_EXIT"]: (self.on_exit, self.ctx.processes.on_exit)}
        return {t: r.with_handlers(*handlers[t]) for t, r in records.DECODERS.items()}

    def instruments(self) -> list:
        return telemetry.process_instruments(self.ctx.processes)

    def section(self):
        return RequestsSection()

    # ---- the reader's lag: the kernel's pressure rule (requests.bpf.c) ----
    def ring(self, name: bytes, callback):
        if name != b"req_events":
            return callback

        def cb(ctx, data, size) -> int:
            self._read += 1
            if self._read - self._told >= REQ_READ_TELL_EVERY:
                self.tell_consumed()  # within a long poll too: a stale count reads as lag, and refuses begins
            return callback(ctx, data, size)
        return cb

    def in_flight(self) -> int:
        return len(self.joiner.open)

    def polled(self) -> None:
        self.tell_consumed()

    def tell_consumed(self) -> None:
        if self._read != self._told:
            # the kernel compares it with what it reserved: the reader's lag (enum mcp_req_flow)
            self.ctx.bpf[b"req_flow"][ctypes.c_int(C["MCP_FLOW_CONSUMED"])] = ctypes.c_uint64(self._read)
            self._told = self._read

    # ---- records ----
    def on_begin(self, rec: records.ReqBegin) -> None:
        self.joiner.on_begin(rec)
        self.ctx.processes.attrs(rec.hdr.tgid, rec.hdr.comm)  # while it surely lives

    def on_end(self, rec: records.ReqEnd) -> None:
        self.ctx.finish(self.joiner.on_end(rec))
        if rec.reason == "thread_exit" and rec.hdr.tid == rec.hdr.tgid:
            # the process is exiting: without a proc_stats entry it sends no PROC_EXIT, and a
            # process started at its pid within IDENTITY_TTL_S would get this one's identity
            self.ctx.processes.forget(rec.hdr.tgid)

    def on_exit(self, rec: records.ProcExit) -> None:
        for fr in self.joiner.on_proc_exit(rec):
            self.ctx.finish(fr)

    # ---- periodic ----
    def tick(self) -> None:
        now = time.monotonic()
        if now >= self._next_expiry:
            self._next_expiry = now + min(EXPIRY_SCAN_S, self.idle_expiry_s / 2)
            self.expire()

    def expire(self) -> None:
        b = self.ctx.bpf
        idle_ns = int(self.idle_expiry_s * 1e9)
        now_ns = time.monotonic_ns()
        reqs, tgids = b[b"req_by_tid"], b[b"tgid_state"]
        live = set()
        for k, st in list(reqs.items()):
            key = (st.tgid, k.value)
            if now_ns - st.begin_ns < idle_ns:
                live.add(key)
                continue
            try:
                del reqs[k]
            except KeyError:  # ended by the kernel meanwhile
                continue
            ts = tgids.get(ctypes.c_uint32(st.tgid))
            if ts is not None and ctypes.c_int32(ts.open).value > 0:
                ts.open -= 1
                owners.update_existing(tgids, ctypes.c_uint32(st.tgid), ts)
                owners.release_open(b, ts)
            self.ctx.finish(self.joiner.on_expired(st.tgid, k.value, st.request_id, st.begin_ns, now_ns,
                                                   counters_from(st.c)))
        self.joiner.drop_orphans(now_ns - idle_ns, live)
