"""HTTP BEGIN + END records -> FinishedRequest (core/request.py), the same shape a marked request has,
so that every capability's evidence and the request span apply unchanged. Pure: no I/O, no clocks.

A request's counters are differences of the kernel's running totals between its BEGIN and its END:
  the request's thread (the one that read its head's end): FinishedRequest.counters, as a marked request's;
  its process and its serving group (cgroup or process tree): FinishedRequest.scopes, whose span
  attributes each counter's capability renders (core/request.py).
Requests in flight at once share those figures: hostagent.request.{thread,process,group}.concurrency
say how many were in flight at most, in that scope, while this one was (1: the figures are its own).
An END with reason "closed" ends every request still open on its connection from its seq on (the
kernel sends one record for a close); "marked" drops the request (its process marks its own).
Every oddity is counted in `rejected` by reason, never raised.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from ..core import traceparent as tp
from ..core.decode import Counters
from ..core.request import FinishedRequest
from . import parse
from .records import HttpBegin, HttpEnd

TREE_GROUP = 1 << 62  # bpf/common.bpf.c MCP_TREE_GROUP: a process-tree group's key, | the root's tgid
MAX_OPEN = 65536  # BEGINs waiting for their END; past it the oldest are dropped and counted
MAX_EXPIRED = 4096  # requests ended by expiry whose END may still come: kept to drop it, oldest first
END_REASONS = {"complete": "http_complete", "closed": "http_closed"}
SCOPES = ("thread", "process", "group")


@dataclass
class _Open:
    rec: HttpBegin
    head: parse.RequestHead | None
    scope_keys: tuple  # (thread key, process key, group key) it is counted under
    peak: dict = field(default_factory=lambda: dict.fromkeys(SCOPES, 1))  # most in flight at once, by scope


def request_id(conn_id: int, seq: int) -> int:
    """A request's id: its connection entry (first-seen time, ns) and its number on it."""
    return ((conn_id << 16) ^ seq) & 0xFFFF_FFFF_FFFF_FFFF


def _delta(after: Counters, before: Counters) -> Counters | None:
    """None when a total went backwards: the kernel's LRU dropped and remade the entry meanwhile."""
    d = after - before
    return None if any(v < 0 for v in d.astuple()) else d


class HttpJoiner:
    def __init__(self, rejected: Counter | None = None) -> None:
        self.open: dict[tuple[int, int, int], _Open] = {}  # (tgid, conn_id, seq)
        self.in_scope: dict[tuple, set] = {}  # scope key -> open keys counted there
        self.expired: OrderedDict = OrderedDict()  # keys ended by expiry: their late END is dropped
        self.rejected: Counter[str] = Counter() if rejected is None else rejected

    def on_begin(self, rec: HttpBegin) -> None:
        key = (rec.hdr.tgid, rec.conn_id, rec.seq)
        if len(self.open) >= MAX_OPEN:
            self.forget(next(iter(self.open)))
            self.rejected["http_open_full"] += 1
        head = parse.parse(rec.head) if not rec.partial else None
        if head is None:
            self.rejected["http_bad_head"] += 1
        elif head.problem:
            self.rejected[f"http_head_{head.problem}"] += 1
        scope_keys = (("thread", rec.hdr.tid), ("process", rec.hdr.tgid), ("group", rec.group or ("none", rec.hdr.tgid)))
        o = _Open(rec, head, scope_keys)
        self.open[key] = o
        for scope, sk in zip(SCOPES, scope_keys):
            peers = self.in_scope.setdefault(sk, set())
            peers.add(key)
            n = len(peers)
            for k in peers:
                p = self.open[k].peak
                if p[scope] < n:
                    p[scope] = n

    def on_end(self, rec: HttpEnd) -> list[FinishedRequest]:
        """The requests this END ends: one, or with reason "closed" those behind it on the connection too."""
        key = (rec.hdr.tgid, rec.conn_id, rec.seq)
        if rec.reason == "marked":
            self.rejected["http_marked_process"] += 1  # the process marks its requests: its marker spans count
            if key in self.open:
                self.forget(key)
            return []
        if self.expired.pop(key, None) is not None:
            self.rejected["http_end_after_expiry"] += 1
            return []
        o = self.open.get(key)
        if o is not None:
            self.forget(key)
        else:
            self.rejected["http_begin_lost"] += 1
        out = [self._finish(o, rec.hdr.tgid, rec.begin_tid, rec.conn_id, rec.seq, rec.hdr.comm, rec.begin_ns,
                            rec.hdr.ts_ns, END_REASONS[rec.reason], rec)]
        if rec.reason == "closed":
            behind = sorted(k for k in self.open if k[0] == rec.hdr.tgid and k[1] == rec.conn_id and k[2] > rec.seq)
            for k in behind:
                b = self.open[k]
                self.forget(k)
                out.append(self._finish(b, k[0], b.rec.hdr.tid, k[1], k[2], b.rec.hdr.comm, b.rec.hdr.ts_ns,
                                        rec.hdr.ts_ns, "http_closed", rec, answered=False))
        return out

    def on_gone(self, tgid: int, conn_id: int, now_ns: int, reason: str) -> list[FinishedRequest]:
        """The requests open on a connection whose END will never come (its process exited): reason
        "process_exit"."""
        out = []
        for key in sorted(k for k in self.open if k[0] == tgid and k[1] == conn_id):
            out.extend(self._ended(key, now_ns, reason))
        return out

    def expire(self, before_ns: int, now_ns: int) -> list[FinishedRequest]:
        """Requests begun before before_ns: ended as "expired"; an END that comes later is dropped."""
        out = []
        for key in [k for k, o in self.open.items() if o.rec.hdr.ts_ns < before_ns]:
            out.extend(self._ended(key, now_ns, "expired"))
            self.expired[key] = True
            if len(self.expired) > MAX_EXPIRED:
                self.expired.popitem(last=False)
        return out

    def tgids(self) -> set[int]:
        return {k[0] for k in self.open}

    def _ended(self, key, now_ns: int, reason: str) -> list[FinishedRequest]:
        o = self.open.get(key)
        if o is None:
            return []
        self.forget(key)
        b = o.rec
        return [self._finish(o, key[0], b.hdr.tid, key[1], key[2], b.hdr.comm, b.hdr.ts_ns, now_ns, reason, None)]

    def forget(self, key) -> None:
        """Drop an open request without a span (its END was lost, or will not count)."""
        o = self.open.pop(key, None)
        if o is None:
            return
        for sk in o.scope_keys:
            peers = self.in_scope.get(sk)
            if peers is not None:
                peers.discard(key)
                if not peers:
                    del self.in_scope[sk]

    def _finish(self, o: _Open | None, tgid, tid, conn_id, seq, comm, begin_ns, end_ns, reason,
                end: HttpEnd | None, answered: bool = True) -> FinishedRequest:
        attrs: dict = {"network.protocol.name": "http",
                       "hostagent.http.connection.fd": end.fd if end else o.rec.fd}
        counters = Counters()
        scopes = []
        parent, state = None, "begin_lost"
        cgroup_id = 0
        if o is not None:
            b = o.rec
            cgroup_id = b.hdr.cgroup_id
            for scope in SCOPES:
                attrs[f"hostagent.request.{scope}.concurrency"] = o.peak[scope]
            if b.reads > 1:
                attrs["hostagent.http.request.head_reads"] = b.reads
                attrs["hostagent.http.request.head_wait"] = (b.hdr.ts_ns - b.first_ns) / 1e9
            h = o.head
            if h is not None:
                attrs.update({"http.request.method": h.method, "url.path": h.path,
                              "network.protocol.version": h.version})
                if h.problem:
                    attrs["hostagent.http.head_problem"] = h.problem
                    state = "invalid"  # a head the server should refuse: no trace is joined from it
                elif h.traceparent is None:
                    state = "missing"
                else:
                    parent = tp.parse(h.traceparent)
                    state = "valid" if parent else "invalid"
                    if parent is None:
                        self.rejected["bad_traceparent"] += 1
                if not h.complete or b.truncated:
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
        status = 0
        if end is not None and answered:
            status = end.status
            attrs["hostagent.http.response.size"] = end.written
            if end.interim:
                attrs["hostagent.http.response.interim.size"] = end.interim
            attrs["hostagent.http.response.framing"] = end.mode
            if end.status:
                attrs["http.response.status_code"] = end.status
        return FinishedRequest(tgid, tid, request_id(conn_id, seq), comm, cgroup_id, begin_ns, end_ns, parent,
                               state, reason, counters, attributes=attrs, scopes=tuple(scopes), http_status=status,
                               source="http")
