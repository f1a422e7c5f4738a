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


def kswapd_cpu_ticks(proc_root: str = "/proc") -> dict[int, int]:
    """node -> utime+stime (clock ticks) of each kswapdN kernel thread, from /proc/PID/stat."""
    out = {}
    for name in os.listdir(proc_root):
        if not name.isdigit():
            continue
        comm = read_text(f"{proc_root}/{name}/comm").strip()
        if not comm.startswith("kswapd") or not comm[6:].isdigit():
            continue
        stat = read_text(f"{proc_root}/{name}/stat")
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 12:
            out[int(comm[6:])] = int(fields[11]) + int(fields[12])
    return out
