"""Python mirror of bpf/common.h, the records every family shares (the counters, the record header,
owners, the raw tracepoint copy): constants read from the header itself, structs as ctypes. Each
capability mirrors its own header beside its decoder (<capability>/records.py), with header_constants.

A header is the one place a record's layout is defined. Constants (#define and enum values) are parsed
from it at import, so they cannot disagree; struct layouts are mirrored and checked against the C
compiler's own sizeof/offsetof by tests/core/test_layout.py.
"""

from __future__ import annotations

import ctypes
import os
import re
from importlib import resources
from types import MappingProxyType

def bpf_source_dir() -> str:
    """Directory holding the BPF C sources (package data of mcp_hostagent.bpf)."""
    return str(resources.files("mcp_hostagent.bpf"))


def parse_constants(text: str) -> dict[str, int]:
    """`#define NAME <int>` lines and `enum { NAME = <int>, NEXT, ... }` members."""
    out: dict[str, int] = {}
    for m in re.finditer(r"^#define\s+(MCP_\w+)\s+(0x[0-9a-fA-F]+|\d+)U?\b", text, re.M):
        out[m.group(1)] = int(m.group(2), 0)
    for body in re.findall(r"enum\s+\w+\s*\{(.*?)\};", text, re.S):
        value = -1
        for item in re.sub(r"/\*.*?\*/", "", body, flags=re.S).split(","):
            item = item.strip()
            if not item:
                continue
            name, _, expr = item.partition("=")
            value = int(expr.strip(), 0) if expr.strip() else value + 1
            out[name.strip()] = value
    return out


def header_constants(*headers: str, directory: str | None = None) -> MappingProxyType:
    """The constants of common.h and of these headers (names in bpf/, or in directory)."""
    text = [resources.files("mcp_hostagent.bpf").joinpath("common.h").read_text()]
    for h in headers:
        if directory:
            with open(os.path.join(directory, h)) as f:
                text.append(f.read())
        else:
            text.append(resources.files("mcp_hostagent.bpf").joinpath(h).read_text())
    return MappingProxyType(parse_constants("\n".join(text)))


C = header_constants()

u8, u16, u32, u64 = ctypes.c_uint8, ctypes.c_uint16, ctypes.c_uint32, ctypes.c_uint64


class Counters(ctypes.Structure):
    _fields_ = [(name, u64) for name in (
        "faults", "vcsw", "ivcsw", "offcpu_ns",
        "direct_reclaims", "direct_reclaim_ns", "memcg_reclaims", "memcg_reclaim_ns", "reclaimed_pages",
        "kswapd_wakeups",
        "cu_launch", "cu_launch_ptsz", "cu_launch_ex", "cu_launch_ex_ptsz", "cu_graph_launch",
        "cu_ctx_ops", "cu_ctx_ns", "cu_syncs", "cu_sync_ns", "cu_allocs", "cu_alloc_ns", "cu_frees",
        "cu_free_ns", "nv_ioctls", "nv_ioctl_ns", "sampled",
        "offcpu_runnable_ns", "wakeup_wait_ns", "wakeups", "cu_alloc_oom",
        "oncpu_ns", "oncpu_homed_ns", "oncpu_remote_ns", "pagecache_added_bytes",
    )]


class Hdr(ctypes.Structure):
    _fields_ = [
        ("type", u16),
        ("size", u16),
        ("tgid", u32),
        ("tid", u32),
        ("cpu", u32),
        ("ts_ns", u64),
        ("cgroup_id", u64),
        ("comm", ctypes.c_char * 16),
    ]


class OwnerKey(ctypes.Structure):
    _fields_ = [("kind", u32), ("pad", u32), ("id", u64)]


class EvTpRaw(ctypes.Structure):
    _fields_ = [("h", Hdr), ("kind", u32), ("len", u32), ("data", u8 * C["MCP_TP_RAW_LEN"])]


# C struct name -> ctypes mirror; tests/core/test_layout.py walks this table and each capability's.
STRUCTS = {"mcp_counters": Counters, "mcp_hdr": Hdr, "mcp_owner_key": OwnerKey, "mcp_ev_tp_raw": EvTpRaw}
