"""Mark requests for mcp-agent: tell it "this thread now serves request X". No dependencies.

Wire format (docs/MARKER.md; struct mcp_mark in the agent's bpf/mcp_records.h, checked against this
file by the agent's tests/requests/test_marker_package.py):
    { u32 magic = 0x4150434d; u16 version = 1; u16 op (1 begin, 2 end); u64 request_id;
      char traceparent[56] (W3C traceparent, NUL-terminated; may be empty; one longer than 55
      characters fills all 56 bytes, no NUL: _wire) }   -- 72 bytes, little-endian
and ioctl(-1, 0x4048eb01, &mark). The call fails at once with EBADF (fd -1 is never open); the
agent's syscalls:sys_enter_ioctl program has read the struct before the kernel looked at the fd.
Without the agent it costs one failed syscall. The kernel supplies the thread id, so a process
marks only itself.

    from mcp_hostagent_marker import request
    with request(traceparent=headers.get("traceparent")):
        handle(...)

One-line integrations: mcp_hostagent_marker.asgi.MarkRequests (ASGI middleware) and
mcp_hostagent_marker.otel.MarkServerSpans (an OpenTelemetry span processor).
"""

from __future__ import annotations

import contextlib
import ctypes
import random
from typing import Iterator

MAGIC = 0x4150434D  # "MCPA"
VERSION = 1
MARK_CMD = 0x4048EB01  # _IOW(0xeb, 0x01, struct mcp_mark)
OP_BEGIN, OP_END = 1, 2
TRACEPARENT_LEN = 56


class Mark(ctypes.Structure):
    _fields_ = [("magic", ctypes.c_uint32), ("version", ctypes.c_uint16), ("op", ctypes.c_uint16),
                ("request_id", ctypes.c_uint64), ("traceparent", ctypes.c_char * TRACEPARENT_LEN)]


_libc = ctypes.CDLL(None, use_errno=True)
_ioctl = _libc.ioctl
_ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
_ioctl.restype = ctypes.c_int


def _wire(traceparent: bytes) -> bytes:
    """The traceparent field's bytes: an invalid value must never arrive as a valid one.

    A version-00 traceparent is exactly 55 characters, and W3C Trace Context reads a later version
    by its first 55 only if the 56th is "-" (its versioning rules). So up to 55 characters go as
    they are, NUL-terminated, and a longer value's first 56 fill the field without a NUL: the agent
    sees that it is longer than 55, refuses a version-00 one, and reads a later one as W3C says. Cut
    to 55 instead, "00-<trace>-<parent>-01x" would arrive valid. A NUL inside would end the value
    early where the agent reads it (one after 55 characters, the same): it goes as "?", which no
    traceparent holds, as a non-ASCII character of a str does."""
    return traceparent.replace(b"\0", b"?")[:TRACEPARENT_LEN]


def _mark(op: int, request_id: int, traceparent: bytes) -> None:
    m = Mark(MAGIC, VERSION, op, request_id, _wire(traceparent))
    _ioctl(-1, MARK_CMD, ctypes.addressof(m))


def _as_bytes(traceparent: str | bytes | None) -> bytes:
    if traceparent is None:
        return b""
    if isinstance(traceparent, str):
        return traceparent.encode("ascii", "replace")
    return bytes(traceparent)


def new_request_id() -> int:
    return random.getrandbits(64) | 1


def begin(request_id: int, traceparent: str | bytes | None = None) -> None:
    """Mark the start of a request on the calling thread."""
    _mark(OP_BEGIN, request_id, _as_bytes(traceparent))


def end(request_id: int = 0) -> None:
    """Mark the end of the calling thread's request (0: whichever is open)."""
    _mark(OP_END, request_id, b"")


@contextlib.contextmanager
def request(traceparent: str | bytes | None = None, request_id: int | None = None) -> Iterator[int]:
    """Mark a request on this thread for the duration of the block; yields the request id."""
    rid = new_request_id() if request_id is None else request_id
    begin(rid, traceparent)
    try:
        yield rid
    finally:
        end(rid)
