"""Health tracepoint records from bpf/health.bpf.c -> typed records (xid.XidRecord, pcie.records'
AerRecord and LinkEventRecord), decoded with the format tracefs gives at run time.

The BPF side copies the first MCP_TP_RAW_LEN bytes of each record instead of naming fields, because
these events come and go with the NVIDIA module and the kernel config and their layouts change
between driver and kernel versions. Each event's format file is read the first time one of its
records arrives: while our program is attached, perf holds a reference on the module that owns the
event (perf_trace_init() -> trace_event_try_get_ref()), so the layout cannot change under it. When no
format file can be read, the decoders' default layouts stand in (nvidia_dev_xid as recorded on the
H200; aer_event and pcie_link_event derived from kernel source). Records that do not fit raise
core.tracefs.RecordError, which the agent counts (tracepoint_record) and skips.

The copy's 8-byte common header is zero (the kernel keeps a pt_regs pointer there while the program
runs: bpf/health.bpf.c), so it is rebuilt from what the BPF record header knows: common_pid is the
thread that ran the tracepoint (current->pid, our hdr.tid), common_type the format's id.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable

from ..core.decode import TpRaw
from ..core.kernel import TRACEFS
from ..core.records import C
from ..core.tracefs import RecordError, TracepointFormat, decode_captured, load_formats
from ..pcie.records import (
    AER_EVENT_FORMAT, PCIE_LINK_EVENT_FORMAT, AerRecord, LinkEventRecord, decode_aer, decode_link_event,
)
from ..reclaim.oom import MARK_VICTIM_FORMAT, OomKill, decode_mark_victim
from .tracepoints import MISSING_WHY
from .xid import NVIDIA_DEV_XID_FORMAT, XidRecord, decode_xid

# struct trace_entry (include/linux/trace_events.h): unsigned short type, unsigned char flags,
# unsigned char preempt_count, int pid
COMMON_SIZE = 8

# enum mcp_tp_kind -> (tracefs event, default format, typed decoder). The test kind has no typed
# decoder: its records come back as TpFields (tests/gpuhealth/test_bpf_health.py).
KINDS: dict[int, tuple[str, TracepointFormat | None, Callable | None]] = {
    C["MCP_TP_NVIDIA_DEV_XID"]: ("nvidia/nvidia_dev_xid", NVIDIA_DEV_XID_FORMAT, decode_xid),
    C["MCP_TP_AER_EVENT"]: ("ras/aer_event", AER_EVENT_FORMAT, decode_aer),
    C["MCP_TP_PCIE_LINK_EVENT"]: ("pci/pcie_link_event", PCIE_LINK_EVENT_FORMAT, decode_link_event),
    C["MCP_TP_OOM_MARK_VICTIM"]: ("oom/mark_victim", MARK_VICTIM_FORMAT, decode_mark_victim),
    C["MCP_TP_TEST_EXEC"]: ("sched/sched_process_exec", None, None),
}


@dataclass(frozen=True)
class TpFields:
    """Every field of a record of an event without a typed decoder."""

    event: str
    fields: dict
    truncated: tuple[str, ...]  # __data_loc fields cut at the end of the BPF copy


class HealthDecoder:
    """Not thread-safe: the agent's thread only."""

    def __init__(self, tracefs_root: str = TRACEFS):
        self.root = tracefs_root
        self._formats: dict[int, TracepointFormat] = {}
        self.format_source: dict[str, str] = {}  # event -> "tracefs" | "built-in (why)"
        self.truncated = 0  # records decoded with a string cut at the end of the copy

    def format_for(self, kind: int) -> TracepointFormat:
        fmt = self._formats.get(kind)
        if fmt is not None:
            return fmt
        name, default, _ = KINDS[kind]
        got = load_formats(self.root, (name,), MISSING_WHY)[name]
        if isinstance(got, TracepointFormat):
            fmt, src = got, "tracefs"
        elif default is not None:
            fmt, src = default, f"built-in ({got.reason})"
        else:
            raise RecordError(f"{name}: no format: {got.reason}")
        self._formats[kind] = fmt
        self.format_source[name] = src
        return fmt

    def decode(self, rec: TpRaw) -> XidRecord | AerRecord | LinkEventRecord | OomKill | TpFields:
        entry = KINDS.get(rec.kind)
        if entry is None:
            raise RecordError(f"unknown tracepoint kind {rec.kind}")
        name, _, typed = entry
        if len(rec.data) < COMMON_SIZE:
            raise RecordError(f"{name}: {len(rec.data)} bytes, shorter than the common header")
        fmt = self.format_for(rec.kind)
        data = struct.pack("<HBBi", (fmt.id or 0) & 0xFFFF, 0, 0, rec.hdr.tid) + rec.data[COMMON_SIZE:]
        if typed is None:
            fields, cut = decode_captured(data, fmt, captured=True)
            out = TpFields(name, fields, cut)
        else:
            out = typed(data, fmt, captured=True)
        if getattr(out, "truncated", False):
            self.truncated += 1
        return out
