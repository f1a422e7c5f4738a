"""Zero-code HTTP requests: the records of bpf/http.bpf.c -> the request path (core/request.py).

BEGIN/END are paired by the joiner (join.py) into the FinishedRequest a marked request becomes, and
handed to the request path: the same evidence, span and duration metric. A connection stays in the
kernel's http_conn only while a request is in flight on it; those of processes that exited are
removed here, their requests ended (exit closes fds without close(2), so the kernel sees no close),
and requests idle past requests.idle_expiry_s are ended here as expired (their entries stay: the
kernel gives a connection's share back when its socket closes). The agent tells the kernel how many
BEGINs of each owner it has read: what waits unread, for the pressure rule (http.bpf.c).

Without sock:sock_*_length (kernels before 6.3, records.sock_tracepoints) the kernel cannot tell a
socket's bytes from a file's, and each new connection's fd is checked here in /proc instead.
"""

from __future__ import annotations

import ctypes
import os
import time

from ..core import records as R
from ..core.capability import Capability
from .join import HttpJoiner
from . import records
from .records import C

SCAN_S = 2.0  # between scans of the kernel's connection map
MAX_CHECKED = 65536  # connections whose fd type is remembered (no sock tracepoints)
MAX_OWNERS = 8192  # bpf/common.bpf.c MCP_MAX_OWNERS
READ_TELL_EVERY = 64  # BEGINs read between updates of http_owner_read inside one poll


class Http(Capability):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.idle_expiry_s = ctx.cfg.requests_idle_expiry_s
        self.proc_root = ctx.proc_root
        self.sock_tracepoints = records.sock_tracepoints(ctx.cfg)
        self.joiner = HttpJoiner(ctx.health.rejected)
        self._next_scan = 0.0
        self._checked: dict[tuple[int, int], bool] = {}  # (tgid, conn_id) -> its fd is a socket
        self._read_of: dict[tuple[int, int], int] = {}  # owner -> BEGINs read (since the agent started)
        self._told_owners: set = set()
        self._unsaid = 0

    @property
    def bpf(self):
        return self.ctx.bpf

    def finish(self, fr) -> None:
        self.ctx.finish(fr)

    def in_flight(self) -> int:
        return len(self.joiner.open)

    def routes(self):
        handlers = {C["MCP_EV_HTTP_BEGIN"]: self.on_begin, C["MCP_EV_HTTP_END"]: self.on_end}
        return {t: r.with_handlers(handlers[t]) for t, r in records.DECODERS.items()}

    # ---- what was read of each owner: the kernel's pressure rule (http.bpf.c http_begin_ok) ----
    def ring(self, name: bytes, on_event):
        """The ring buffer callback for http_events (the BEGINs read by owner are counted in on_begin)."""
        if name != b"http_events":
            return on_event

        def cb(ctx, data, size) -> int:
            r = on_event(ctx, data, size)
            if self._unsaid >= READ_TELL_EVERY:
                self.tell_read()  # within a long poll too: a stale count reads as unread, and refuses begins
            return r
        return cb

    def tell_read(self) -> None:
        """http_owner_read[owner] = the BEGINs of that owner read so far, for the owners read since last told."""
        if not self._told_owners:
            return
        table = self.bpf[b"http_owner_read"]
        for owner in self._told_owners:
            table[R.OwnerKey(owner[0], 0, owner[1])] = ctypes.c_uint64(self._read_of[owner])
        self._told_owners.clear()
        self._unsaid = 0

    # ---- records ----
    def on_begin(self, rec: records.HttpBegin) -> None:
        for owner in rec.owners:
            if owner not in self._read_of and len(self._read_of) >= MAX_OWNERS:
                self._read_of.pop(next(iter(self._read_of)))  # the oldest: its kernel entry keeps the count told
            self._read_of[owner] = self._read_of.get(owner, 0) + 1
            self._told_owners.add(owner)
        self._unsaid += 1
        if not self.sock_tracepoints and not self._socket(rec):
            return
        self.joiner.on_begin(rec)

    def on_end(self, rec: records.HttpEnd) -> None:
        if not self.sock_tracepoints and self._checked.get((rec.hdr.tgid, rec.conn_id)) is False:
            return  # not a socket: its BEGIN was dropped, and counted
        for fr in self.joiner.on_end(rec):
            self.finish(fr)

    def _socket(self, rec: records.HttpBegin) -> bool:
        """Without the sock tracepoints: is this connection's fd a socket? /proc/PID/fd/N of a socket
        reads socket:[inode]. Unreadable (the fd or process gone): yes, the kernel saw a head on it."""
        key = (rec.hdr.tgid, rec.conn_id)
        if key not in self._checked:
            if len(self._checked) >= MAX_CHECKED:
                self._checked.pop(next(iter(self._checked)))
            try:
                ok = os.readlink(f"{self.proc_root}/{rec.hdr.tgid}/fd/{rec.fd}").startswith("socket:")
            except OSError:
                ok = True
            self._checked[key] = ok
            if not ok:
                self.joiner.rejected["http_not_socket"] += 1
                self._forget_conn(rec.hdr.tgid, rec.fd, rec.conn_id)
        return self._checked[key]

    def _forget_conn(self, tgid: int, fd: int, conn_id: int) -> None:
        conns = self.bpf[b"http_conn"]
        k = records.HttpConnKey(tgid, fd)
        c = conns.get(k)
        if c is not None and c.conn_id == conn_id:
            try:
                del conns[k]
            except KeyError:
                pass

    # ---- periodic ----
    def tick(self) -> None:
        self.tell_read()
        now = time.monotonic()
        if now >= self._next_scan:
            self._next_scan = now + min(SCAN_S, self.idle_expiry_s / 2)
            self.scan()

    def _alive(self, tgid: int, gen_ns: int) -> bool:
        """Whether the process tgid that made an entry at gen_ns (kernel monotonic) still runs: a
        reused pid's process started after the entry. /proc/PID/stat field 22: start time in ticks."""
        try:
            with open(f"{self.proc_root}/{tgid}/stat", "rb") as f:
                fields = f.read(4096).rsplit(b")", 1)[1].split()
            if fields[0] in (b"Z", b"X"):
                return False
            start_ns = int(fields[19]) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return False
        # CLOCK_BOOTTIME ticks against CLOCK_MONOTONIC ns: equal but for suspend, so a process can
        # only look younger than it is; a tick's slack either way
        return start_ns <= gen_ns + 10_000_000

    def scan(self) -> None:
        """Entries of processes gone: removed, their requests ended; requests idle past expiry ended."""
        conns = self.bpf[b"http_conn"]
        now_ns = time.monotonic_ns()
        alive: dict[int, bool] = {}
        for k, c in list(conns.items()):  # one pass: each entry is two bpf() calls
            tgid = k.tgid
            if tgid not in alive:
                alive[tgid] = self._alive(tgid, c.conn_id)
            if alive[tgid]:
                continue
            try:
                del conns[k]
            except KeyError:  # closed by the kernel meanwhile
                continue
            for fr in self.joiner.on_gone(tgid, c.conn_id, now_ns, "process_exit"):
                self.finish(fr)
        # BEGINs of processes gone whose entry went with them (a close or exit the kernel saw
        # first, its END lost), and requests idle past expiry
        for tgid in self.joiner.tgids() - set(alive):
            if not os.path.exists(f"{self.proc_root}/{tgid}"):
                for key in [k for k in self.joiner.open if k[0] == tgid]:
                    self.joiner.forget(key)
                    self.joiner.rejected["http_end_lost"] += 1
        for fr in self.joiner.expire(now_ns - int(self.idle_expiry_s * 1e9), now_ns):
            self.finish(fr)
        procs = self.bpf[b"http_proc"]  # the kernel deletes its own at exit (requests.bpf.c, at exit) where process_exit is attached
        for k, p in list(procs.items()):
            if not self._alive(k.value, p.gen):
                procs.pop(k, None)
