"""Request marker for serving processes: tell the agent "this thread now serves request X".

Wire format (language-agnostic, docs/MARKER.md): fill `struct mcp_mark` from bpf/mcp_records.h
    { u32 magic = 0x4150434d; u16 version = 1; u16 op (1 begin, 2 end); u64 request_id;
      char traceparent[56] (W3C traceparent, NUL-terminated; may be empty) }   -- 72 bytes, little-endian
and call ioctl(-1, 0x4048eb01, &mark). The call fails at once with EBADF (fd -1 is never open);
the agent's syscalls:sys_enter_ioctl program has read the struct before the kernel looked at the fd.
Nothing is compiled and no library is loaded beyond libc; without the agent it costs one failed
syscall (~0.1 us from C; with the agent ~0.8 us, docs/PERFORMANCE.md). The kernel supplies the thread id, so a process marks only itself.

    from mcp_hostagent.marker import request
    with request(traceparent=headers.get("traceparent")):
        handle(...)
"""

from __future__ import annotations

import contextlib
import ctypes
import random
from typing import Iterator

from .core.records import C, Mark

MARK_CMD = C["MCP_MARK_CMD"]

_libc = ctypes.CDLL(None, use_errno=True)
_ioctl = _libc.ioctl
_ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
_ioctl.restype = ctypes.c_int


def _mark(op: int, request_id: int, traceparent: bytes) -> None:
    m = Mark(C["MCP_MARK_MAGIC"], C["MCP_MARK_VERSION"], op, request_id, traceparent[: C["MCP_TRACEPARENT_LEN"] - 1])
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
    _mark(C["MCP_OP_BEGIN"], request_id, _as_bytes(traceparent))


def end(request_id: int = 0) -> None:
    """Mark the end of the calling thread's request (0: whichever is open)."""
    _mark(C["MCP_OP_END"], request_id, b"")


@contextlib.contextmanager
def request(traceparent: str | bytes | None = None, request_id: int | None = None) -> Iterator[int]:
    """Mark a request on this thread for the duration of the block; yields the request id."""
    rid = new_request_id() if request_id is None else request_id
    begin(rid, traceparent)
    try:
        yield rid
    finally:
        end(rid)
