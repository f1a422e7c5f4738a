"""Requests: the marked windows of serving threads (bpf/requests.bpf.c) -> request spans.

BEGIN/END/EXIT records are paired by the joiner (join.py); a finished request gathers the other
capabilities' evidence for its window (core/capability.py) and becomes one span with its stalls as
children (telemetry.py). Requests whose END never comes are expired here from the kernel map.
"""

from __future__ import annotations

import ctypes
import time

from ..core import records as R
from ..core.capability import NONE
from ..core.decode import Route, counters_from
from ..core.health import AgentHealth
from . import owners, records, telemetry as T
from .join import RequestJoiner

EXPIRY_SCAN_S = 5.0
# records read from req_events between updates of req_flow[CONSUMED] inside one poll (a map write)
REQ_READ_TELL_EVERY = 64


class Requests:
    def __init__(self, bpf, *, idle_expiry_s: float, health: AgentHealth, processes, telemetry,
                 evidence=(), listeners=()):
        """evidence: functions of a FinishedRequest -> core.capability.Evidence (what the other
        capabilities saw in its window), merged in order; listeners: called with each FinishedRequest
        and its span's context (for links to it made later: a storm's to its victims)."""
        self.bpf = bpf
        self.idle_expiry_s = idle_expiry_s
        self.joiner = RequestJoiner(health.rejected)  # one Counter for every user-space refusal
        self.health = health
        self.processes = processes
        self.telemetry = telemetry
        self.evidence = list(evidence)
        self.listeners = list(listeners)
        self._next_expiry = 0.0
        self._read = self._told = 0  # records read from req_events; the count last written to the kernel

    def routes(self) -> dict[int, Route]:
        handlers = {R.C["MCP_EV_REQ_BEGIN"]: (self.on_begin,), R.C["MCP_EV_REQ_END"]: (self.on_end,),
                    R.C["MCP_EV_PROC_EXIT"]: (self.on_exit, self.processes.on_exit)}
        return {t: r.with_handlers(*handlers[t]) for t, r in records.DECODERS.items()}

    def handlers(self) -> dict[int, object]:
        """Records of other capabilities this one consumes: reclaim stalls inside a request."""
        return {R.C["MCP_EV_RECLAIM_STALL"]: self.joiner.on_stall}

    def instruments(self):
        return T.INSTRUMENTS

    # ---- the reader's lag: the kernel's pressure rule (requests.bpf.c) ----
    def counting(self, on_event):
        """The ring buffer callback for req_events: on_event, counting what was read."""
        def cb(ctx, data, size) -> int:
            self._read += 1
            if self._read - self._told >= REQ_READ_TELL_EVERY:
                self.tell_consumed()  # within a long poll too: a stale count reads as lag, and refuses begins
            return on_event(ctx, data, size)
        return cb

    def tell_consumed(self) -> None:
        if self._read != self._told:
            # the kernel compares it with what it reserved: the reader's lag (enum mcp_req_flow)
            self.bpf[b"req_flow"][ctypes.c_int(R.C["MCP_FLOW_CONSUMED"])] = ctypes.c_uint64(self._read)
            self._told = self._read

    # ---- records ----
    def on_begin(self, rec: records.ReqBegin) -> None:
        self.joiner.on_begin(rec)
        self.processes.attrs(rec.hdr.tgid, rec.hdr.comm)  # while it surely lives

    def on_end(self, rec: records.ReqEnd) -> None:
        self.finish(self.joiner.on_end(rec))
        if rec.reason == "thread_exit" and rec.hdr.tid == rec.hdr.tgid:
            # the process is exiting: without a proc_stats entry it sends no PROC_EXIT, and a
            # process started at its pid within IDENTITY_TTL_S would get this one's identity
            self.processes.forget(rec.hdr.tgid)

    def on_exit(self, rec: records.ProcExit) -> None:
        for fr in self.joiner.on_proc_exit(rec):
            self.finish(fr)

    def finish(self, fr) -> None:
        proc_attrs = self.processes.attrs(fr.tgid, fr.comm)
        ev = NONE
        for of in self.evidence:
            ev = ev + of(fr)
        ctx = self.telemetry.span(T.request_span(fr, proc_attrs, ev))
        self.telemetry.record(T.DURATION, *T.duration_row(fr, proc_attrs))
        self.health.requests[fr.end_reason] += 1
        for listen in self.listeners:
            listen(fr, ctx)

    # ---- periodic ----
    def tick(self) -> None:
        now = time.monotonic()
        if now >= self._next_expiry:
            self._next_expiry = now + min(EXPIRY_SCAN_S, self.idle_expiry_s / 2)
            self.expire()

    def expire(self) -> None:
        b = self.bpf
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
            self.finish(self.joiner.on_expired(st.tgid, k.value, st.request_id, st.begin_ns, now_ns,
                                               counters_from(st.c)))
        self.joiner.drop_orphans(now_ns - idle_ns, live)
