"""HTTP BEGIN + END records -> FinishedRequest (requests/join.py), the same shape a marked request has,
so that every capability's evidence and the request span apply unchanged. Pure: no I/O, no clocks.

A request's counters are differences of the kernel's running totals between its BEGIN and its END:
  the request's thread (the one that read its head): FinishedRequest.counters, as a marked request's;
  its process and its serving group (the thread's cgroup): span attributes (telemetry.py).
Requests in flight at once in one process share the process's and the group's differences (and, on
an event loop, the thread's): hostagent.request.concurrency says how many were in flight at most.
Every oddity is counted in `rejected` by reason, never raised.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..core.decode import Counters
from ..requests import traceparent as tp
from ..requests.join import FinishedRequest
from . import parse
from .records import HttpBegin, HttpEnd

TREE_GROUP = 1 << 62  # bpf/common.bpf.c MCP_TREE_GROUP: a process-tree group's key, | the root's tgid
MAX_OPEN = 65536  # BEGINs waiting for their END; past it the oldest are dropped and counted
END_REASONS = {"complete": "http_complete", "next_request": "http_next_request", "closed": "http_closed"}


@dataclass
class _Open:
    rec: HttpBegin
    head: parse.RequestHead | None
    peak: int = 1  # most requests of its process in flight at once while it was


def request_id(conn_id: int, seq: int) -> int:
    """A request's id: its connection (first-seen time, ns) and its number on it."""
    return ((conn_id << 16) ^ seq) & 0xFFFF_FFFF_FFFF_FFFF


def _delta(after: Counters, before: Counters) -> Counters | None:
    """None when a total went backwards: the kernel's LRU dropped and remade the entry meanwhile."""
    d = after - before
    return None if any(v < 0 for v in d.astuple()) else d


class HttpJoiner:
    def __init__(self, rejected: Counter | None = None) -> None:
        self.open: dict[tuple[int, int, int], _Open] = {}  # (tgid, conn_id, seq)
        self.by_tgid: dict[int, set[tuple[int, int, int]]] = {}
        self.rejected: Counter[str] = Counter() if rejected is None else rejected

    def on_begin(self, rec: HttpBegin) -> None:
        key = (rec.hdr.tgid, rec.conn_id, rec.seq)
        if len(self.open) >= MAX_OPEN:
            self.forget(next(iter(self.open)))
            self.rejected["http_open_full"] += 1
        head = parse.parse(rec.head)
        if head is None:
            self.rejected["http_bad_head"] += 1
        self.open[key] = _Open(rec, head)
        peers = self.by_tgid.setdefault(rec.hdr.tgid, set())
        peers.add(key)
        n = len(peers)
        for k in peers:
            o = self.open[k]
            o.peak = max(o.peak, n)

    def on_end(self, rec: HttpEnd) -> FinishedRequest:
        key = (rec.hdr.tgid, rec.conn_id, rec.seq)
        o = self.open.get(key)
        if o is not None:
            self.forget(key)
        else:
            self.rejected["http_begin_lost"] += 1
        return self._finish(o, rec.hdr.tgid, rec.begin_tid, rec.conn_id, rec.seq, rec.hdr.comm, rec.begin_ns,
                            rec.hdr.ts_ns, END_REASONS[rec.reason], rec)

    def on_gone(self, tgid: int, conn_id: int, seq: int, now_ns: int, reason: str) -> FinishedRequest | None:
        """A request whose END will never come: its connection left the kernel map (process exit,
        expiry). reason: "process_exit" | "expired"."""
        key = (tgid, conn_id, seq)
        o = self.open.get(key)
        if o is None:
            return None
        self.forget(key)
        b = o.rec
        return self._finish(o, tgid, b.hdr.tid, conn_id, seq, b.hdr.comm, b.hdr.ts_ns, now_ns, reason, None)

    def forget(self, key) -> None:
        """Drop an open request without a span (its END was lost)."""
        self.open.pop(key, None)
        peers = self.by_tgid.get(key[0])
        if peers is not None:
            peers.discard(key)
            if not peers:
                del self.by_tgid[key[0]]

    def _finish(self, o: _Open | None, tgid, tid, conn_id, seq, comm, begin_ns, end_ns, reason,
                end: HttpEnd | None) -> FinishedRequest:
        attrs: dict = {"hostagent.request.source": "http", "network.protocol.name": "http",
                       "hostagent.http.connection.fd": end.fd if end else o.rec.fd}
        counters = Counters()
        scopes = []
        parent, state = None, "begin_lost"
        cgroup_id = 0
        if o is not None:
            b = o.rec
            cgroup_id = b.hdr.cgroup_id
            attrs["hostagent.request.concurrency"] = o.peak
            h = o.head
            if h is not None:
                attrs.update({"http.request.method": h.method, "url.path": h.path,
                              "network.protocol.version": h.version})
                if h.traceparent is None:
                    state = "missing"
                else:
                    parent = tp.parse(h.traceparent)
                    state = "valid" if parent else "invalid"
                    if parent is None:
                        self.rejected["bad_traceparent"] += 1
                if not h.complete:
                    attrs["hostagent.http.head_truncated"] = True
            else:
                state = "unreadable"
            if end is not None:
                for name, after, before in (("thread", end.thread, b.thread), ("process", end.proc, b.proc),
                                            ("group", end.grp, b.grp)):
                    d = _delta(after, before)
                    if d is None:
                        self.rejected["http_counters_reset"] += 1
                        attrs[f"hostagent.request.{name}.counters"] = "reset"
                    elif name == "thread":
                        counters = d
                    else:
                        scopes.append((name, d))
                if end.group & TREE_GROUP:
                    attrs["hostagent.request.group.root_pid"] = end.group & 0xFFFF_FFFF
                elif end.group:
                    attrs["hostagent.request.group.cgroup_id"] = end.group
        if end is not None:
            attrs["hostagent.http.response.size"] = end.written
            attrs["hostagent.http.response.framing"] = end.mode
            if end.status:
                attrs["http.response.status_code"] = end.status
        return FinishedRequest(tgid, tid, request_id(conn_id, seq), comm, cgroup_id, begin_ns, end_ns, parent,
                               state, reason, counters, attributes=attrs, scopes=tuple(scopes),
                               http_status=end.status if end else 0)
