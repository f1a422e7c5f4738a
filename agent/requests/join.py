"""Join request begin/end records into finished requests (core/request.py). Pure: no I/O, no clocks,
no BPF.

The kernel keeps the authoritative thread -> request state and accumulates the counters; this module
pairs the BEGIN record (traceparent, comm, cgroup) with the END record (counters, reason), and ends
what the kernel can no longer end: requests whose process exited or that idled past expiry.
Every oddity is counted in `rejected` by reason, never raised.
"""

from __future__ import annotations

from collections import Counter

from ..core import traceparent as tp
from ..core.decode import Counters
from ..core.request import FinishedRequest
from .records import ProcExit, ReqBegin, ReqEnd


class RequestJoiner:
    def __init__(self, rejected: Counter | None = None) -> None:
        self.open: dict[tuple[int, int], ReqBegin] = {}
        self.rejected: Counter[str] = Counter() if rejected is None else rejected  # by reason

    def on_begin(self, rec: ReqBegin) -> None:
        key = (rec.hdr.tgid, rec.hdr.tid)
        if key in self.open:
            # The kernel sends the superseded END first; an open entry here means that END was lost.
            self.rejected["end_lost"] += 1
        self.open[key] = rec

    def on_end(self, rec: ReqEnd) -> FinishedRequest:
        begin = self.open.pop((rec.hdr.tgid, rec.hdr.tid), None)
        return self._finish(begin, rec.hdr.tgid, rec.hdr.tid, rec.request_id, rec.hdr.comm, rec.hdr.cgroup_id,
                            rec.begin_ns, rec.hdr.ts_ns, rec.reason, rec.counters)

    def on_proc_exit(self, rec: ProcExit) -> list[FinishedRequest]:
        """The kernel ends each exiting thread's request itself; anything still open here lost its END."""
        keys = [k for k in self.open if k[0] == rec.hdr.tgid]
        out = []
        for k in keys:
            b = self.open.pop(k)
            self.rejected["end_lost"] += 1
            out.append(self._finish(b, k[0], k[1], b.request_id, b.hdr.comm, b.hdr.cgroup_id,
                                    b.hdr.ts_ns, rec.hdr.ts_ns, "process_exit", Counters()))
        return out

    def on_expired(self, tgid: int, tid: int, request_id: int, begin_ns: int, now_ns: int,
                   counters: Counters) -> FinishedRequest:
        """A request the requests capability removed from the kernel map after idling past requests.idle_expiry_s."""
        b = self.open.pop((tgid, tid), None)
        comm, cg = (b.hdr.comm, b.hdr.cgroup_id) if b else (b"", 0)
        return self._finish(b, tgid, tid, request_id, comm, cg, begin_ns, now_ns, "expired", counters)

    def drop_orphans(self, older_than_ns: int, live: set[tuple[int, int]]) -> int:
        """Forget BEGIN records whose kernel entry is gone (their END was lost in the ring buffer)."""
        stale = [k for k, b in self.open.items() if b.hdr.ts_ns < older_than_ns and k not in live]
        for k in stale:
            del self.open[k]
        self.rejected["end_lost"] += len(stale)
        return len(stale)

    def _finish(self, begin, tgid, tid, request_id, comm, cgroup_id, begin_ns, end_ns, reason, counters):
        if begin is not None and begin.request_id != request_id:
            # the thread's earlier request, whose END was lost (and this one's BEGIN)
            self.rejected["end_lost"] += 1
        if begin is None or begin.request_id != request_id:
            self.rejected["begin_lost"] += 1
            parent, state = None, "begin_lost"
        elif not begin.traceparent:
            parent, state = None, "missing"
        else:
            parent = tp.parse(begin.traceparent)
            state = "valid" if parent else "invalid"
            if parent is None:
                self.rejected["bad_traceparent"] += 1
        return FinishedRequest(tgid, tid, request_id, comm, cgroup_id, begin_ns, end_ns, parent, state,
                               reason, counters)
