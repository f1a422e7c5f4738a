"""Watched processes: who they are (identity, cached) and their cumulative counters (proc_stats).

proc_stats holds one struct mcp_counters per watched tgid, summed by every capability's probes
(faults and switches by requests.bpf.c, reclaim by reclaim.bpf.c, CUDA by cuda.bpf.c); it is read
once a tick into rows, which each capability's per-process metrics of its own counters
(per_process) and the top snapshot read. The process's own accounting in /proc (faults by type,
storage I/O) is this module's.
"""

from __future__ import annotations

import os
import threading
import time

from ..telemetry.spec import Instrument
from .decode import Counters, counters_from
from .identity import ProcessRegistry

EXITED_KEEP_S = 30.0  # an exited process's final counters stay in the rows for a couple of metric exports
IDENTITY_TTL_S = 1.0
# The map read's rows (metrics, `top`) revalidate an identity that has not changed for this long only
# this often: every watched process's lookup every tick was ~1% of a core with --watch all and ~100
# processes (kernel threads, without a command line, are described afresh on every lookup), and
# metrics go out every 10 s. A young or just exec'd process is still checked every IDENTITY_TTL_S.
ROW_IDENTITY_TTL_S = 5.0


class Processes:
    def __init__(self, proc_root: str = "/proc", command_line: str = "redacted"):
        self.proc_root = proc_root
        self.registry = ProcessRegistry(proc_root=proc_root, command_line=command_line)
        self.rows: dict[int, tuple[dict, Counters]] = {}  # the last map read, with exited processes kept
        self._exited: dict[int, tuple[float, dict, Counters]] = {}
        self._attrs_cache: dict[int, tuple[float, dict, float]] = {}  # pid -> (checked, attrs, same since)
        self._faults: dict[int, tuple[int, int]] = {}
        self._io: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()  # rows and faults, read by the metric reader thread
        self.on_gone = None  # callable(set of pids): their metric state can go

    def attrs(self, pid: int, comm: bytes = b"", ttl_s: float = IDENTITY_TTL_S) -> dict:
        """Identity attributes, looked up (psutil, /proc) at most once per IDENTITY_TTL_S per pid: a
        lookup costs ~150 us, and a serving process ends hundreds of requests a second. Process exit
        drops the entry (PROC_EXIT, or the main thread's exit inside a request), and the registry's
        (pid, start time) check catches pid reuse at the next refresh."""
        now = time.monotonic()
        hit = self._attrs_cache.get(pid)
        if hit is not None and now - hit[0] < (ttl_s if now - hit[2] >= ttl_s else IDENTITY_TTL_S):
            return hit[1]
        attrs = self.registry.attributes(self.registry.lookup(pid, comm))
        if len(self._attrs_cache) >= 8192:
            self._attrs_cache.clear()
        self._attrs_cache[pid] = (now, attrs, hit[2] if hit is not None and hit[1] == attrs else now)
        return attrs

    def forget(self, pid: int) -> None:
        """The process is exiting: a process started at its pid must not get this one's identity."""
        self.registry.forget(pid)
        self._attrs_cache.pop(pid, None)

    def on_exit(self, rec) -> None:
        """requests.records.ProcExit: the process's final counters, kept for EXITED_KEEP_S."""
        attrs = self.attrs(rec.hdr.tgid, rec.hdr.comm)
        self._exited[rec.hdr.tgid] = (time.monotonic() + EXITED_KEEP_S, attrs, rec.counters)
        self.forget(rec.hdr.tgid)

    def read(self, bpf) -> None:
        rows = {}
        table, gone = bpf[b"proc_stats"], []
        for k, v in table.items():
            pid = k.value
            if pid in self._exited:
                # With watch=all a dead task's last sched_switch re-creates the entry its exit probe
                # deleted (post-exit counts: a switch or two). Left there, every process that ever
                # exited stays in the map (up to MCP_MAX_PROCS, then live ones go uncounted), is looked
                # up and exported every tick: agent CPU grew with the host's process churn. The exit
                # record's counters stand; the remnant goes once /proc says the process is gone.
                if not os.path.exists(f"{self.proc_root}/{pid}"):
                    gone.append(k)
                continue
            rows[pid] = (self.attrs(pid, ttl_s=ROW_IDENTITY_TTL_S), counters_from(v))
        for k in gone:
            try:
                del table[k]
            except KeyError:
                pass
        now = time.monotonic()
        for pid, (until, attrs, c) in list(self._exited.items()):
            if now > until:
                del self._exited[pid]
            elif pid not in rows:
                rows[pid] = (attrs, c)
        self.set_rows(rows, *self._proc_accounting(rows))

    def set_rows(self, rows: dict[int, tuple[dict, Counters]], faults: dict[int, tuple[int, int]],
                 io: dict[int, tuple[int, int]] | None = None) -> None:
        """rows: pid -> (identity attributes, cumulative counters since the agent saw the process);
        faults: pid -> (minflt, majflt) since the process started, from /proc/PID/stat; io: pid ->
        (read_bytes, write_bytes) from /proc/PID/io."""
        with self._lock:
            dropped = self.rows.keys() - rows.keys()
            self.rows, self._faults, self._io = rows, faults, io or {}
        if dropped and self.on_gone is not None:
            self.on_gone(dropped)

    def _proc_accounting(self, rows: dict) -> tuple[dict[int, tuple[int, int]], dict[int, tuple[int, int]]]:
        """pid -> (minflt, majflt) from /proc/PID/stat: the kernel's own split of major and minor
        faults, which exceptions:page_fault_user does not give (no kprobes here); pid -> (read_bytes,
        write_bytes) from /proc/PID/io: what the process made the storage layer read and write, page
        cache misses and readahead included, cache hits not (a model loading from disk, not from cache)."""
        faults, io = {}, {}
        for pid in rows:
            try:
                with open(f"{self.proc_root}/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                faults[pid] = (int(fields[7]), int(fields[9]))
                with open(f"{self.proc_root}/{pid}/io") as f:
                    kv = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
                io[pid] = (int(kv["read_bytes"]), int(kv["write_bytes"]))
            except (OSError, IndexError, ValueError, KeyError):  # exited since the map read; io without task I/O accounting
                continue
        return faults, io

    # ---- metrics (read at collection time: rows are replaced whole, never mutated) ----
    def snapshot_rows(self) -> list[tuple[int, tuple[dict, Counters]]]:
        with self._lock:
            return list(self.rows.items())

    @staticmethod
    def metric_identity(attrs: dict) -> dict:
        return metric_identity(attrs)

    def per_process(self, pick):
        """A metric's read(): pick(Counters) -> [(value, extra attributes)] for each watched process."""
        def read():
            with self._lock:
                rows = list(self.rows.values())
            return [(v, {**metric_identity(a), **extra}) for a, c in rows for v, extra in pick(c)]
        return read

    def _io_rows(self):
        with self._lock:
            rows = [(self.rows[p][0], b) for p, b in self._io.items() if p in self.rows]
        return [(v, {**metric_identity(a), "disk.io.direction": d})
                for a, (rd, wr) in rows for v, d in ((rd, "read"), (wr, "write"))]

    def _faults_rows(self):
        with self._lock:
            rows = [(self.rows[p][0], f) for p, f in self._faults.items() if p in self.rows]
        return [(v, {**metric_identity(a), "process.paging.fault_type": t})
                for a, (mn, mj) in rows for v, t in ((mn, "minor"), (mj, "major"))]

    def instruments(self) -> list[Instrument]:
        return [
            Instrument("process.paging.faults", "counter", "{fault}",
                       "faults by type since the process started (/proc/PID/stat)", self._faults_rows),
            Instrument("process.disk.io", "counter", "By",
                       "bytes the process made the storage layer read and write since it started (/proc/PID/io): "
                       "a model loading from disk, where page cache hits count nothing", self._io_rows),
        ]


# Metric labels name the process, boundedly: the command line, owner, start time and cgroup path
# stay on the span resource (one Prometheus series per distinct command line would be unbounded).
METRIC_IDENTITY = ("process.pid", "process.executable.name", "container.id", "k8s.pod.uid")


def metric_identity(attrs: dict) -> dict:
    return {k: attrs[k] for k in METRIC_IDENTITY if k in attrs}
