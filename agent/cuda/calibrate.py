"""The governor's per-hit cost: a memfd stand-in of the agent's own and the calibration timed on it.

When the first libcuda appears, calibrate_standin() times a function of the agent's own that starts
with the same first instruction as that library's cuLaunchKernel (read from the file, never loaded: a
library a process maps may be anyone's), with and without our launch program attached (per-hit cost,
trap included; the trap's cost depends on the probed instruction: 7.4 us on libc's labs() vs ~1.1 us
on cuLaunchKernel in the H200 VM). calibrate() is the timing itself, on any target (libc's labs() by
default). The result, a Calibration, is what the governor (governor.py) weighs launch rates by.
"""

from __future__ import annotations

import ctypes
import os
import re
import statistics
import threading
import time
from dataclasses import dataclass

from . import uprobes


@dataclass
class Calibration:
    cost_ns: float  # per hit of our launch program, trap included
    call_ns: float  # the call without a probe
    target: str
    rounds: int


def _read(path: str, limit: int = 16 << 20) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode(errors="replace")
    except OSError:
        return ""


# ---- calibration ----
def _libc_labs():
    """(path, address, callable) of libc's labs(): tiny, and nothing else in this process calls it."""
    from bcc import BPF

    libc = ctypes.CDLL("libc.so.6")
    for line in _read("/proc/self/maps").splitlines():
        p = line.split(None, 5)
        if len(p) == 6 and re.search(r"/libc[.-][^/]*so", p[5]):
            path = p[5]
            break
    else:
        raise RuntimeError("libc not found in /proc/self/maps")
    addr = BPF._check_path_symbol(path.encode(), b"labs", None, -1)[1]
    fn = libc.labs
    fn.argtypes, fn.restype = [ctypes.c_long], ctypes.c_long
    return path, addr, fn


# ---- the calibration stand-in: code of the agent's own, never a library found in a process ----
# The per-hit cost of a uprobe depends on the probed instruction: x86 uprobes emulate some (branches,
# nops, push: arch/x86/kernel/uprobes.c branch_setup_xol_ops/push_setup_xol_ops) in one trap and
# single-step the rest out of line, a second trap (~7x the cost in the H200 VM). So the stand-in
# starts with the same first instruction as the library's cuLaunchKernel, copied only from this
# table of ones that are safe to run on their own, then undoes it and returns 0.
_RIP32 = object()  # a rip-relative disp32, pointed at a zero qword in the stand-in's own page
_PROLOGUES: tuple[tuple[bytes, tuple, bytes], ...] = (
    # (first bytes of the function, instruction to copy, what undoes it)
    (b"\xf3\x0f\x1e\xfa", (b"\xf3\x0f\x1e\xfa",), b""),  # endbr64
    *((bytes([0x50 + r]), (bytes([0x50 + r]),), bytes([0x58 + r])) for r in range(8) if r != 4),  # push r
    *((bytes([0x41, 0x50 + r]), (bytes([0x41, 0x50 + r]),), bytes([0x41, 0x58 + r])) for r in range(8)),
    (b"\x90", (b"\x90",), b""),
    (b"\x66\x90", (b"\x66\x90",), b""),
    (b"\x0f\x1f\x00", (b"\x0f\x1f\x00",), b""),
    (b"\x0f\x1f\x40\x00", (b"\x0f\x1f\x40\x00",), b""),
    (b"\x0f\x1f\x44\x00\x00", (b"\x0f\x1f\x44\x00\x00",), b""),
    (b"\x66\x0f\x1f\x44\x00\x00", (b"\x66\x0f\x1f\x44\x00\x00",), b""),
    (b"\x0f\x1f\x80\x00\x00\x00\x00", (b"\x0f\x1f\x80\x00\x00\x00\x00",), b""),
    (b"\x48\x83\xec", None, b""),  # sub $imm8, %rsp: copied with its imm8 (below)
    (b"\xe9", (b"\xe9\x00\x00\x00\x00",), b""),  # jmp rel32 (a thunk): to the next instruction
    # loads and compares on a global (rip-relative), into caller-saved registers only
    *((bytes([0x48, 0x8b, m]), (bytes([0x48, 0x8b, m]), _RIP32), b"") for m in (0x05, 0x0d, 0x15, 0x35, 0x3d)),
    *((bytes([0x8b, m]), (bytes([0x8b, m]), _RIP32), b"") for m in (0x05, 0x0d, 0x15, 0x35, 0x3d)),
    (b"\x80\x3d", (b"\x80\x3d", _RIP32, b"\x00"), b""),  # cmpb $imm8, x(%rip)
    (b"\x83\x3d", (b"\x83\x3d", _RIP32, b"\x00"), b""),  # cmpl $imm8, x(%rip)
)
_RET0 = b"\x31\xc0\xc3"  # xor %eax, %eax; ret
STANDIN_OFFSET = 0x100  # not 0: bcc takes a zero address for "no address"
STANDIN_SIZE = 0x1000
_ZERO_AT = 0x800  # the zero qword rip-relative loads read


def standin_code(first: bytes) -> tuple[bytes, str]:
    """(code placed at STANDIN_OFFSET, what its first instruction is) for a function whose first
    bytes are `first`. An instruction not in _PROLOGUES gives a stand-in starting with endbr64 and
    says so."""
    for pre, insn, undo in _PROLOGUES:
        if not first.startswith(pre):
            continue
        if insn is None:  # sub $imm8, %rsp
            if len(first) < 4:
                break
            insn, undo = (first[:4],), b"\x48\x83\xc4" + first[3:4]
        code = b""
        for part in insn:
            if part is _RIP32:  # disp32 from the end of this instruction
                end = STANDIN_OFFSET + len(code) + 4 + sum(len(p) for p in insn[insn.index(part) + 1:])
                code += (_ZERO_AT - end).to_bytes(4, "little", signed=True)
            else:
                code += part
        return code + undo + _RET0, code.hex()
    return b"\xf3\x0f\x1e\xfa" + _RET0, f"not recognised ({first[:8].hex()}): endbr64 in its place"


def first_bytes(path: str, offset: int, n: int = 16) -> bytes:
    """The first n bytes of the function at file offset `offset` of a (trusted) library: read, never
    loaded."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


class Standin:
    """The stand-in's code in a memfd of the agent's own, mapped executable here: a file, so uprobes
    can be attached to it (uprobe_register() takes shmem inodes), and on no file system a user can
    write or that may be mounted noexec. Call it, attach at (path, STANDIN_OFFSET), close()."""

    def __init__(self, code: bytes):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._libc = libc
        page = bytearray(b"\xcc" * STANDIN_SIZE)  # int3 around the code
        page[STANDIN_OFFSET:STANDIN_OFFSET + len(code)] = code
        page[_ZERO_AT:_ZERO_AT + 8] = bytes(8)
        self.fd = os.memfd_create("mcp-hostagent-calibrate", os.MFD_CLOEXEC)
        try:
            os.write(self.fd, bytes(page))
            addr = libc.mmap(None, STANDIN_SIZE, 0x1 | 0x4, 0x02, self.fd, 0)  # PROT_READ|EXEC, MAP_PRIVATE
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap stand-in: {os.strerror(ctypes.get_errno())}")
        except Exception:
            os.close(self.fd)
            raise
        self.addr = addr
        self.path = f"/proc/self/fd/{self.fd}"
        self.fn = ctypes.CFUNCTYPE(ctypes.c_long, ctypes.c_long)(addr + STANDIN_OFFSET)

    def close(self) -> None:
        if self.fd >= 0:
            self._libc.munmap(ctypes.c_void_p(self.addr), STANDIN_SIZE)
            os.close(self.fd)
            self.fd = -1


def calibrate_standin(bpf, lib_path: str | None, symbol: str = "cuLaunchKernel", n: int = 2000,
                      rounds: int = 11, name: str | None = None) -> Calibration:
    """Per-hit cost of our launch program on the agent's stand-in for symbol's first instruction in
    lib_path (read from the file, see Standin); without lib_path, on an endbr64 stand-in."""
    from bcc import BPF

    first, source = b"", "no library"
    if lib_path:
        off = BPF._check_path_symbol(lib_path.encode(), symbol.encode(), None, -1)[1]
        first = first_bytes(lib_path, off)
        source = f"{name or os.path.basename(lib_path)}:{symbol}"
    code, insn = standin_code(first)
    st = Standin(code)
    try:
        c = calibrate(bpf, target=(st.path, STANDIN_OFFSET, st.fn), n=n, rounds=rounds)
    finally:
        st.close()
    return Calibration(c.cost_ns, c.call_ns, f"stand-in for {source} (first instruction {insn})", rounds)


def _interleaved(bpf, path: str, addr: int, fn_name: str, pid: int, timed, rounds: int):
    """Timings without and with our program attached at path:addr for pid only, alternating which
    goes first each round (drift in these VMs hits both alike): (on, off) lists."""
    up = uprobes.attacher_for(bpf)
    on, off = [], []
    for r in range(rounds):
        for attached in ((False, True) if r % 2 == 0 else (True, False)):
            if not attached:
                off.append(timed())
                continue
            h = up.attach(fn_name, path, addr, pid=pid)
            try:
                on.append(timed())
            finally:
                up.detach(h)
    return on, off


def calibrate(bpf, target=None, n: int = 2000, rounds: int = 11, fn_name: str = "cu_launch") -> Calibration:
    """Per-hit cost of our launch program on this host: time n calls of a tiny function with it attached
    (this thread only; this process with uprobe_multi links, whose pid filter is per process) and without,
    interleaved; the median of the rounds' differences. The calling process is watched meanwhile, so the program takes its
    full path; its traces are removed afterwards.

    target: (library path, address, callable taking one int) or None for libc's labs()."""
    path, addr, call = target or _libc_labs()
    tid, me = threading.get_native_id(), os.getpid()
    watch, procs, threads = bpf[b"watch_tgid"], bpf[b"proc_stats"], bpf[b"cu_thread"]
    was_watched = watch.get(ctypes.c_uint32(me)) is not None
    had_stats = procs.get(ctypes.c_uint32(me)) is not None
    watch[ctypes.c_uint32(me)] = ctypes.c_uint8(1)

    def timed() -> float:
        t0 = time.perf_counter_ns()
        for i in range(n):
            call(i)
        return (time.perf_counter_ns() - t0) / n

    try:
        timed()  # warm
        pid = tid if uprobes.attacher_for(bpf).mode == uprobes.PERF else me
        on, off = _interleaved(bpf, path, addr, fn_name, pid, timed, rounds)
    finally:
        if not was_watched:
            watch.pop(ctypes.c_uint32(me), None)
        if not had_stats:
            procs.pop(ctypes.c_uint32(me), None)
        threads.pop(ctypes.c_uint32(tid), None)
    # each round's own difference: its two timings are milliseconds apart, while these VMs' speed moves
    # by 30-40% over seconds (H200: starts calibrated 330-1,070 ns from the difference of medians)
    return Calibration(max(0.0, statistics.median(a - b for a, b in zip(on, off))), statistics.median(off),
                       f"{os.path.basename(path)}@0x{addr:x}", rounds)
