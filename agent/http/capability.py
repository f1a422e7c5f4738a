"""Zero-code HTTP requests: the records of bpf/http.bpf.c -> the requests capability's spans.

BEGIN/END are paired by the joiner (join.py) into the FinishedRequest a marked request becomes, and
handed to Requests.finish: the same evidence, span and duration metric. Connections whose process
exited, or whose request idled past requests.idle_expiry_s, are removed from the kernel map here
(the kernel sees no close for a process killed with its sockets open: exit closes fds without the
close syscall).
"""

from __future__ import annotations

import ctypes
import os
import time

from ..core import records as R
from .join import HttpJoiner
from . import records

SCAN_S = 5.0  # between scans of the kernel's connection map
MAX_CHECKED = 65536  # connections whose fd type is remembered


class Http:
    def __init__(self, bpf, *, finish, idle_expiry_s: float, rejected, proc_root: str = "/proc", tree: bool = False):
        """finish: Requests.finish (a FinishedRequest -> its span, metric and listeners); tree:
        requests.group = tree (the processes a serving process started before its first request
        join its tree here; later ones by the kernel's fork probe)."""
        self.bpf = bpf
        self.tree = tree
        self.finish = finish
        self.idle_expiry_s = idle_expiry_s
        self.proc_root = proc_root
        self.joiner = HttpJoiner(rejected)
        self._next_scan = 0.0
        self._checked: dict[tuple[int, int], bool] = {}  # (tgid, conn_id) -> its fd is a socket

    def routes(self):
        handlers = {R.C["MCP_EV_HTTP_BEGIN"]: self.on_begin, R.C["MCP_EV_HTTP_END"]: self.on_end}
        return {t: r.with_handlers(handlers[t]) for t, r in records.DECODERS.items()}

    def instruments(self):
        return ()  # request spans and hostagent.request.duration are the requests capability's

    def on_begin(self, rec: records.HttpBegin) -> None:
        """A connection's first request: is its fd a socket? The kernel side only saw a read starting
        with an HTTP method (a watched process reading a file of requests would pass there)."""
        key = (rec.hdr.tgid, rec.conn_id)
        if key not in self._checked:
            if len(self._checked) >= MAX_CHECKED:
                self._checked.pop(next(iter(self._checked)))
            self._checked[key] = self._is_socket(rec.hdr.tgid, rec.fd)
            if not self._checked[key]:
                self.joiner.rejected["http_not_socket"] += 1
                self._forget_conn(rec.hdr.tgid, rec.fd, rec.conn_id)
        if self._checked[key]:
            self.joiner.on_begin(rec)

    def on_end(self, rec: records.HttpEnd) -> None:
        if self._checked.get((rec.hdr.tgid, rec.conn_id)) is False:
            return  # not a socket: its BEGIN was dropped, and counted
        self.finish(self.joiner.on_end(rec))

    def _is_socket(self, tgid: int, fd: int) -> bool:
        """/proc/PID/fd/N of a socket reads socket:[inode]. Unreadable (the fd or process gone): yes,
        the kernel saw an HTTP head on it."""
        try:
            return os.readlink(f"{self.proc_root}/{tgid}/fd/{fd}").startswith("socket:")
        except OSError:
            return True

    def _forget_conn(self, tgid: int, fd: int, conn_id: int) -> None:
        conns = self.bpf[b"http_conn"]
        k = R.HttpConnKey(tgid, fd)
        c = conns.get(k)
        if c is not None and c.conn_id == conn_id:
            try:
                del conns[k]
            except KeyError:
                pass

    def tick(self) -> None:
        now = time.monotonic()
        if now >= self._next_scan:
            self._next_scan = now + min(SCAN_S, self.idle_expiry_s / 2)
            self.scan()

    def seed_trees(self) -> None:
        """requests.group = tree: every descendant of a tree's root (from /proc PPid) joins its tree."""
        roots = {k.value: v.value for k, v in self.bpf[b"tree_root"].items()}
        if not roots:
            return
        children: dict[int, list[int]] = {}
        for name in os.listdir(self.proc_root):
            if not name.isdigit():
                continue
            try:
                with open(f"{self.proc_root}/{name}/stat", "rb") as f:
                    ppid = int(f.read(4096).rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
        table = self.bpf[b"tree_root"]
        for pid, root in list(roots.items()):
            if pid != root:
                continue
            todo = list(children.get(pid, ()))
            while todo:
                c = todo.pop()
                if roots.get(c) != root:
                    table[ctypes.c_uint32(c)] = ctypes.c_uint32(root)
                    roots[c] = root
                todo.extend(children.get(c, ()))

    def root_of(self, tgid: int) -> int | None:
        v = self.bpf[b"tree_root"].get(ctypes.c_uint32(tgid))
        return None if v is None else v.value

    def scan(self) -> None:
        if self.tree:
            self.seed_trees()
        conns = self.bpf[b"http_conn"]
        now_ns = time.monotonic_ns()
        idle_ns = int(self.idle_expiry_s * 1e9)
        alive: dict[int, bool] = {}
        live = set()  # the requests still in the kernel map: (tgid, conn_id, seq)
        for k, c in list(conns.items()):  # one pass: each entry is two bpf() calls
            tgid = k.tgid
            if tgid not in alive:
                alive[tgid] = os.path.exists(f"{self.proc_root}/{tgid}")
            open_req = c.state != R.C["MCP_HTTP_IDLE"]
            if alive[tgid] and not (open_req and now_ns - c.begin_ns >= idle_ns):
                live.add((tgid, c.conn_id, c.seq))
                continue
            try:
                del conns[k]
            except KeyError:  # closed by the kernel meanwhile
                continue
            if open_req:
                fr = self.joiner.on_gone(tgid, c.conn_id, c.seq, now_ns, "expired" if alive[tgid] else "process_exit")
                if fr is not None:
                    self.finish(fr)
        # BEGINs whose END was lost (ring full) and whose connection has moved on
        for key, o in list(self.joiner.open.items()):
            if key not in live and now_ns - o.rec.hdr.ts_ns >= idle_ns:
                self.joiner.forget(key)
                self.joiner.rejected["http_end_lost"] += 1
