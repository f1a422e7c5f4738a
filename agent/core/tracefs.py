"""Tracepoint formats and raw records: parse a tracefs events/<group>/<event>/format file, decode a
record with it, walk a tracefs ring-buffer page. Pure apart from load_formats' reads; nothing here
knows any one event.

Kernel facts relied on: a record starts with the common header (u16 type, u8 flags, u8 preempt_count,
s32 pid); a `__data_loc` field is a u32 whose low 16 bits are the offset of the data from the record's
start and high 16 bits its length (the string's NUL included).
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping


@dataclass(frozen=True)
class TpField:
    name: str
    ctype: str
    offset: int
    size: int
    signed: bool
    data_loc: bool  # __data_loc: u32 (offset | length << 16) pointing into the record


@dataclass(frozen=True)
class TracepointFormat:
    name: str
    id: int | None
    fields: tuple[TpField, ...]

    def field(self, name: str) -> TpField:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"{self.name} has no field {name!r}")


@dataclass(frozen=True)
class Unavailable:
    name: str
    reason: str


_FIELD = re.compile(r"field:(?P<decl>[^;]+);\s*offset:(?P<off>\d+);\s*size:(?P<size>\d+);\s*signed:(?P<signed>\d+);")


def parse_format(text: str) -> TracepointFormat:
    """A tracefs events/<group>/<event>/format file -> TracepointFormat."""
    name = re.search(r"^name:\s*(\S+)", text, re.M)
    tp_id = re.search(r"^ID:\s*(\d+)", text, re.M)
    fields = []
    for m in _FIELD.finditer(text):
        decl = m["decl"].strip()
        data_loc = decl.startswith("__data_loc")
        last = decl.split()[-1]  # "dev", "tlp_header[4]"
        fname = re.sub(r"\[.*?\]$", "", last)
        ctype = decl.rsplit(None, 1)[0].replace("__data_loc", "").strip() + last[len(fname):]
        fields.append(TpField(fname, ctype, int(m["off"]), int(m["size"]), m["signed"] == "1", data_loc))
    if not fields:
        raise ValueError("no fields in tracepoint format")
    return TracepointFormat(name[1] if name else "?", int(tp_id[1]) if tp_id else None, tuple(fields))


def load_formats(tracefs_root: str, names: Iterable[str],
                 missing_why: Mapping[str, str] | None = None) -> dict[str, TracepointFormat | Unavailable]:
    """Each event's parsed format, or Unavailable with the reason (tracefs not mounted, event absent:
    missing_why's text for the event where it has one)."""
    out = {}
    events = os.path.join(tracefs_root, "events")
    for name in names:
        path = os.path.join(events, name, "format")
        if not os.path.isdir(events):
            out[name] = Unavailable(name, f"tracefs not mounted at {tracefs_root}")
            continue
        try:
            with open(path) as f:
                out[name] = parse_format(f.read())
        except FileNotFoundError:
            out[name] = Unavailable(name, (missing_why or {}).get(name, "event absent"))
        except (OSError, ValueError) as e:
            out[name] = Unavailable(name, f"{path}: {e}")
    return out


class RecordError(ValueError):
    """A tracepoint record that does not fit its format (counted and skipped by the caller)."""


_INTS = {(1, False): "B", (1, True): "b", (2, False): "H", (2, True): "h", (4, False): "I", (4, True): "i",
         (8, False): "Q", (8, True): "q"}


# A record's __data_loc data lies past its fixed fields, within the perf trace buffer it was built in
# (PERF_MAX_TRACE_SIZE, include/linux/trace_events.h): anything else is not a record of this format.
PERF_MAX_TRACE_SIZE = 8192


def decode_captured(raw: bytes, fmt: TracepointFormat,
                    captured: bool = False) -> tuple[dict[str, int | str | bytes], tuple[str, ...]]:
    """decode_record, and which __data_loc fields were cut. captured: raw is a fixed-size copy of the
    record's first bytes (bpf/common.bpf.c tp_raw_capture), not the whole record, so a __data_loc running past its end
    is clamped to what was copied instead of rejected (an Xid message longer than the copy keeps its
    start); its offset and length must still be plausible for a record of this format."""
    out: dict[str, int | str | bytes] = {}
    cut = []
    fixed_end = max(f.offset + f.size for f in fmt.fields)
    for f in fmt.fields:
        if f.offset + f.size > len(raw):
            raise RecordError(f"{fmt.name}: record of {len(raw)} bytes ends before {f.name}")
        if f.data_loc:
            (loc,) = struct.unpack_from("<I", raw, f.offset)
            off, length = loc & 0xFFFF, loc >> 16
            if off < fixed_end:
                raise RecordError(f"{fmt.name}.{f.name}: __data_loc offset {off} inside the fixed fields")
            if off + length > len(raw):
                if not captured or off + length > PERF_MAX_TRACE_SIZE:
                    raise RecordError(f"{fmt.name}.{f.name}: __data_loc {off}+{length} past the record's "
                                      f"{len(raw)} bytes")
                cut.append(f.name)
            data = raw[off:off + length]
            out[f.name] = data.split(b"\0", 1)[0].decode("utf-8", "replace") if "char" in f.ctype else data
        elif (f.size, f.signed) in _INTS and "[" not in f.ctype:
            (out[f.name],) = struct.unpack_from("<" + _INTS[(f.size, f.signed)], raw, f.offset)
        else:
            data = raw[f.offset:f.offset + f.size]
            out[f.name] = data.split(b"\0", 1)[0].decode("utf-8", "replace") if "char" in f.ctype else data
    return out, tuple(cut)


def decode_record(raw: bytes, fmt: TracepointFormat) -> dict[str, int | str | bytes]:
    """Every field of a raw tracepoint record: integers, __data_loc and char[N] strings (up to the
    first NUL, UTF-8 with replacement), other arrays as bytes. Host (little-endian) byte order."""
    return decode_captured(raw, fmt)[0]


def iter_trace_page(page: bytes, data_offset: int = 16) -> Iterator[tuple[int, bytes]]:
    """(timestamp ns, record) for each event on one tracefs ring-buffer page (per_cpu/cpuN/trace_pipe_raw),
    as laid out by kernel/trace/ring_buffer.c: u64 time stamp, local_t commit (bytes used; the top bits
    are flags), then events with a u32 header: type_len:5, time_delta:27. type_len 1..28: data of
    type_len*4 bytes follows; 0: array[0] holds the length (itself included); 29 padding; 30 time
    extend (delta = array[0] << 27 | time_delta); 31 absolute time stamp. The time stamps are in the
    buffer's trace_clock ("local" by default, not CLOCK_MONOTONIC: set trace_clock to "mono" to join them)."""
    ts, commit = struct.unpack_from("<QQ", page, 0)
    end = data_offset + (commit & 0xFFFFF)
    off = data_offset
    while off + 4 <= min(end, len(page)):
        (hdr,) = struct.unpack_from("<I", page, off)
        type_len, delta = hdr & 0x1F, hdr >> 5
        if type_len == 29:  # padding: a zero delta means the rest of the page
            if delta == 0:
                return
            (length,) = struct.unpack_from("<I", page, off + 4)
            off += 4 + length
            continue
        if type_len == 30:
            (hi,) = struct.unpack_from("<I", page, off + 4)
            ts += (hi << 27) | delta
            off += 8
            continue
        if type_len == 31:
            (hi,) = struct.unpack_from("<I", page, off + 4)
            ts = (ts & ~((1 << 59) - 1)) | (hi << 27) | delta
            off += 8
            continue
        ts += delta
        if type_len == 0:
            (length,) = struct.unpack_from("<I", page, off + 4)
            yield ts, bytes(page[off + 8:off + 4 + length])
            off += 4 + length
        else:
            yield ts, bytes(page[off + 4:off + 4 + type_len * 4])
            off += 4 + type_len * 4
