"""Memory-pressure context from the kernel's own accounting: /proc/vmstat, PSI, cgroup memory
files, kswapd's CPU time. Plain file reads (psutil has no API for vmstat counters or PSI); the
/proc root is overridable for tests. A missing file (no PSI, cgroup gone) reads as empty, never raises.
"""

from __future__ import annotations

import os

VMSTAT_KEYS = (
    "pgfault", "pgmajfault", "pgscan_kswapd", "pgscan_direct", "pgsteal_kswapd", "pgsteal_direct",
    "pgscan_file", "pgscan_anon", "pgsteal_file", "pgsteal_anon", "allocstall_dma", "allocstall_dma32",
    "allocstall_normal", "allocstall_movable", "allocstall_device",
)


def read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def parse_kv(text: str) -> dict[str, int]:
    """`name value` lines (/proc/vmstat, memory.stat) -> ints; malformed lines skipped."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo `Name:   123 kB` lines -> bytes (HugePages_* counts stay counts)."""
    out = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[name.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def read_vmstat(proc_root: str = "/proc") -> dict[str, int]:
    return parse_kv(read_text(f"{proc_root}/vmstat"))


def allocstall(vm: dict[str, int]) -> int:
    return sum(v for k, v in vm.items() if k.startswith("allocstall_"))


def parse_psi(text: str) -> dict[str, dict[str, float]]:
    """PSI format (Documentation/accounting/psi.rst): `some avg10=.. avg60=.. avg300=.. total=..`."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        kind, *fields = line.split()
        vals = {}
        for f in fields:
            k, _, v = f.partition("=")
            try:
                vals[k] = float(v)
            except ValueError:
                continue
        if kind in ("some", "full"):
            out[kind] = vals
    return out


def read_psi(path: str = "/proc/pressure/memory") -> dict[str, dict[str, float]]:
    return parse_psi(read_text(path))


def _stat_ticks(proc_root: str, pid: int) -> tuple[str, int] | None:
    """(comm, utime+stime in clock ticks) of a task, from /proc/PID/stat; None when it is gone."""
    stat = read_text(f"{proc_root}/{pid}/stat")
    head, _, rest = stat.rpartition(")")
    fields = rest.split()
    if not head or len(fields) <= 12:
        return None
    return head.partition("(")[2], int(fields[11]) + int(fields[12])


def _kswapd_node(comm: str) -> int | None:
    return int(comm[6:]) if comm.startswith("kswapd") and comm[6:].isdigit() else None


class KswapdThreads:
    """node -> its kswapdN kernel thread, and their CPU time, without a walk of /proc per window. The
    pids are learnt from the kswapd records (kswapd runs mm_vmscan_kswapd_wake and _sleep itself:
    mm/vmscan.c kswapd(), kswapd_try_to_sleep()) and found once by a walk at start, on a thread of its
    own (find), for the nodes whose kswapd has not woken since; a pid whose comm no longer says kswapdN
    is dropped (node offlined: its thread stopped)."""

    def __init__(self, proc_root: str = "/proc"):
        self.proc_root = proc_root
        self.pids: dict[int, int] = {}

    def learn(self, node: int, pid: int, comm: bytes) -> None:
        if self.pids.get(node) != pid and _kswapd_node(comm.decode("ascii", "replace")) == node:
            self.pids[node] = pid

    def find(self) -> None:
        try:
            names = os.listdir(self.proc_root)
        except OSError:
            return
        for name in names:
            if name.isdigit():
                node = _kswapd_node(read_text(f"{self.proc_root}/{name}/comm").strip())
                if node is not None:
                    self.pids.setdefault(node, int(name))

    def cpu_ticks(self) -> dict[int, int]:
        """node -> utime+stime (clock ticks) of its kswapd thread."""
        out = {}
        for node, pid in list(self.pids.items()):
            got = _stat_ticks(self.proc_root, pid)
            if got is None or _kswapd_node(got[0]) != node:
                self.pids.pop(node, None)
                continue
            out[node] = got[1]
        return out
