"""W3C Trace Context `traceparent` parsing (https://www.w3.org/TR/trace-context/#traceparent-header). Pure."""

from __future__ import annotations

import re
from dataclasses import dataclass

# matched with fullmatch: "$" would also match before a final "\n", letting "...-01\n" through
_TP = re.compile(rb"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


@dataclass(frozen=True)
class TraceParent:
    trace_id: int
    span_id: int
    flags: int


def parse(raw: bytes) -> TraceParent | None:
    """Valid version-00 (or later, forward-compatible) traceparent -> ids; anything else -> None.

    Version 00 is exactly 55 characters. A later version is read, as W3C Trace Context's versioning
    rule says (and OTel's own propagators do), by its first 55 characters, provided whatever follows
    them starts with "-": the marker's field (docs/MARKER.md) carries at most 56 characters of a
    longer value for that check."""
    m = _TP.fullmatch(raw[:55])
    if not m or (len(raw) > 55 and (raw[:2] == b"00" or raw[55:56] != b"-")):
        return None
    version, trace_id, span_id, flags = m.groups()
    # version ff is forbidden; all-zero trace or parent id is invalid by the spec.
    if version == b"ff" or int(trace_id, 16) == 0 or int(span_id, 16) == 0:
        return None
    return TraceParent(int(trace_id, 16), int(span_id, 16), int(flags, 16))
