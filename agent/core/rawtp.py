"""Raw tracepoint copies (bpf/common.bpf.c tp_raw_capture, "tracepoint_raw" probes) -> typed records,
decoded with the format tracefs gives at run time; each kind's decoder is its capability's
(core/capability.py RawKind, Declaration.raw), and the record goes back to that capability.

The BPF side copies the first MCP_TP_RAW_LEN bytes of each record instead of naming fields, because
these events come and go with a module (nvidia) or the kernel config, and their layouts change
between driver and kernel versions. Each event's format file is read the first time one of its
records arrives: while our program is attached, perf holds a reference on the module that owns the
event (perf_trace_init() -> trace_event_try_get_ref()), so the layout cannot change under it. When no
format file can be read, the kind's default layout stands in. Records that do not fit raise
core.tracefs.RecordError, which the agent counts (tracepoint_record) and skips.

The copy's 8-byte common header is zero (the kernel keeps a pt_regs pointer there while the program
runs), so it is rebuilt from what the BPF record header knows: common_pid is the thread that ran the
tracepoint (current->pid, our hdr.tid), common_type the format's id.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from .capability import RawKind
from .decode import TpRaw
from .kernel import TRACEFS
from .records import C
from .tracefs import RecordError, TracepointFormat, decode_captured, load_formats

# struct trace_entry (include/linux/trace_events.h): unsigned short type, unsigned char flags,
# unsigned char preempt_count, int pid
COMMON_SIZE = 8

# The core's own kind: the capture on sched:sched_process_exec that tests compile (MCP_TEST_TP_RAW_EXEC);
# no typed decoder, its records come back as TpFields (tests/core/test_bpf_rawtp.py).
TEST_KIND = {C["MCP_TP_TEST_EXEC"]: RawKind("sched/sched_process_exec", None, None)}


@dataclass(frozen=True)
class TpFields:
    """Every field of a record of an event without a typed decoder."""

    event: str
    fields: dict
    truncated: tuple[str, ...]  # __data_loc fields cut at the end of the BPF copy


class RawDecoder:
    """Not thread-safe: the agent's thread only. kinds: enum mcp_tp_kind value -> RawKind."""

    def __init__(self, kinds: dict[int, RawKind] | None = None, tracefs_root: str = TRACEFS,
                 missing_why: dict[str, str] | None = None):
        self.kinds = {**TEST_KIND, **(kinds or {})}
        self.missing_why = missing_why or {}  # event -> why it may be absent (said when its format is)
        self.root = tracefs_root
        self._formats: dict[int, TracepointFormat] = {}
        self.format_source: dict[str, str] = {}  # event -> "tracefs" | "built-in (why)"
        self.truncated = 0  # records decoded with a string cut at the end of the copy

    def format_for(self, kind: int) -> TracepointFormat:
        fmt = self._formats.get(kind)
        if fmt is not None:
            return fmt
        k = self.kinds[kind]
        name, default = k.event, k.default
        got = load_formats(self.root, (name,), self.missing_why)[name]
        if isinstance(got, TracepointFormat):
            fmt, src = got, "tracefs"
        elif default is not None:
            fmt, src = default, f"built-in ({got.reason})"
        else:
            raise RecordError(f"{name}: no format: {got.reason}")
        self._formats[kind] = fmt
        self.format_source[name] = src
        return fmt

    def decode(self, rec: TpRaw):
        """-> the kind's typed record, or TpFields where it has no decoder."""
        entry = self.kinds.get(rec.kind)
        if entry is None:
            raise RecordError(f"unknown tracepoint kind {rec.kind}")
        name, typed = entry.event, entry.decode
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
