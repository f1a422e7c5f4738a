"""Uprobes as BPF uprobe_multi links where the kernel has them (Linux 6.6+), else bcc's perf-event uprobes.

Why: closing a perf-event uprobe waits for its own RCU-tasks grace period in the kernel (uprobe
unregister under the perf event's teardown), so a process's ~40 libcuda uprobes took 3.7-8.8 s to
detach even in parallel. A BPF link of type uprobe_multi is released with one synchronize_rcu_tasks_trace
per link and those overlap: 40 links closed in parallel took 0.14 s on the same kernel. One link per
(symbol, entry|return) keeps the duty cycler's per-symbol attach and detach.

A program can be attached one way only: the kernel refuses a perf attach of a program loaded with
expected_attach_type BPF_TRACE_UPROBE_MULTI, and a link_create of one loaded without it. bcc caches a
loaded program by name (BPF.funcs), so the mode is fixed per BPF object before its first uprobe program
is loaded: attacher_for(bpf) decides once and every caller on that object shares it.

    a = attacher_for(bpf)           # or attacher_for(bpf, mode="perf") / MCP_UPROBES=perf in the env
    h = a.attach("cu_launch", "/usr/lib/.../libcuda.so.1", 0x1234, retprobe=False, pid=-1)
    a.detach(h)
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from dataclasses import dataclass

from ..core.bpfsys import BPF_PROG_TYPE_KPROBE, prog_load, sys_bpf, why

BPF_LINK_CREATE = 28
BPF_TRACE_UPROBE_MULTI = 48  # enum bpf_attach_type, include/uapi/linux/bpf.h (Linux 6.6)
BPF_F_UPROBE_MULTI_RETURN = 1  # link_create.uprobe_multi.flags
MULTI, PERF = "uprobe_multi", "perf"
ENV = "MCP_UPROBES"  # "perf" forces bcc's perf-event uprobes (tests, a kernel whose multi links misbehave)


class _LinkCreateUprobeMulti(ctypes.Structure):
    """union bpf_attr, the BPF_LINK_CREATE member with its uprobe_multi arm (Linux 6.6):
    prog_fd 0, target_fd 4, attach_type 8, flags 12, then uprobe_multi at 16: path 16, offsets 24,
    ref_ctr_offsets 32, cookies 40, cnt 48, flags 52, pid 56. Padded to 64 bytes; the kernel checks
    that bytes past the fields it knows are zero."""
    _fields_ = [("prog_fd", ctypes.c_uint32),
                ("target_fd", ctypes.c_uint32),  # 0: newer kernels refuse anything else for uprobe_multi
                ("attach_type", ctypes.c_uint32),
                ("flags", ctypes.c_uint32),
                ("path", ctypes.c_uint64),  # const char *
                ("offsets", ctypes.c_uint64),  # const __u64 *, file offsets
                ("ref_ctr_offsets", ctypes.c_uint64),
                ("cookies", ctypes.c_uint64),
                ("cnt", ctypes.c_uint32),
                ("uflags", ctypes.c_uint32),  # BPF_F_UPROBE_MULTI_RETURN
                ("pid", ctypes.c_uint32),  # 0: every process; else a process (tgid) filter
                ("_pad", ctypes.c_uint8 * 4)]


assert ctypes.sizeof(_LinkCreateUprobeMulti) == 64


def _link_create(prog_fd: int, path: bytes, offset: int, retprobe: bool, pid: int) -> tuple[int, int]:
    pbuf = ctypes.create_string_buffer(path)
    offs = (ctypes.c_uint64 * 1)(offset)
    a = _LinkCreateUprobeMulti(prog_fd=prog_fd, attach_type=BPF_TRACE_UPROBE_MULTI,
                               path=ctypes.addressof(pbuf), offsets=ctypes.addressof(offs), cnt=1,
                               uflags=BPF_F_UPROBE_MULTI_RETURN if retprobe else 0,
                               pid=ctypes.c_uint32(pid).value if pid not in (-1, None) else 0)
    return sys_bpf(BPF_LINK_CREATE, a)


_probe_lock = threading.Lock()
_probed: tuple[bool, str] | None = None


def multi_supported() -> tuple[bool, str]:
    """(supported, why not): libbpf's probe_uprobe_multi_link, once per process. A 2-instruction kprobe
    program loaded with expected_attach_type BPF_TRACE_UPROBE_MULTI, linked to path "/": EBADF (not a
    regular file) means the attach type is known. Then pid -1: EINVAL on kernels whose pid filter is a
    process filter; the first ones (6.6-6.9 before the fix) filtered by thread and answer ESRCH, and are
    treated as lacking it, as libbpf does."""
    global _probed
    with _probe_lock:
        if _probed is None:
            _probed = _probe()
        return _probed


def _probe() -> tuple[bool, str]:
    insns = (0x00000000000000b7).to_bytes(8, "little") + (0x0000000000000095).to_bytes(8, "little")  # r0 = 0; exit
    prog, err = prog_load(BPF_PROG_TYPE_KPROBE, insns, b"GPL", attach_type=BPF_TRACE_UPROBE_MULTI)
    if prog < 0:
        return False, f"BPF_PROG_LOAD with expected_attach_type uprobe_multi: {why(err)}"
    try:
        fd, err = _link_create(prog, b"/", 0, False, 0)
        if fd >= 0:
            os.close(fd)
        if fd >= 0 or err != errno.EBADF:
            got = why(err) if fd < 0 else "succeeded on /"
            return False, f"kernel lacks BPF uprobe_multi links (Linux 6.6+): link_create {got}"
        fd, err = _link_create(prog, b"/", 0, False, 0xFFFFFFFF)
        if fd >= 0:
            os.close(fd)
        if fd >= 0 or err != errno.EINVAL:
            return False, "kernel's uprobe_multi pid filter is per thread (fixed in 6.10 and stable kernels)"
        return True, ""
    finally:
        os.close(prog)


class AttachError(Exception):
    """An attach that failed; str() is the one-line reason, errno the kernel's answer (0: unknown)."""

    def __init__(self, err: int, msg: str):
        super().__init__(msg)
        self.errno = err


@dataclass
class Handle:
    """An attached uprobe: a link fd (multi) or a bcc event name (perf)."""
    fd: int = -1
    ev: bytes = b""


class UprobeAttacher:
    """Attach and detach single uprobes of one bcc BPF object's programs, one mechanism for the object."""

    def __init__(self, bpf, mode: str | None = None):
        self.bpf = bpf
        forced = mode or (PERF if os.environ.get(ENV, "").strip().lower() == "perf" else None)
        if forced == PERF:
            self.mode, self.reason = PERF, f"forced ({ENV}=perf)" if not mode else "forced"
        else:
            ok, reason = multi_supported()
            self.mode, self.reason = (MULTI, "") if ok else (PERF, reason)
        self._lock = threading.Lock()

    @property
    def mechanism(self) -> str:
        """For reports: 'uprobe_multi links' or 'perf-event uprobes (why)'."""
        return "BPF uprobe_multi links" if self.mode == MULTI else f"perf-event uprobes ({self.reason})"

    def _func(self, fn_name: bytes):
        from bcc import BPF

        with self._lock:  # bcc's load_func checks and fills its cache without a lock
            if self.mode == MULTI:
                return self.bpf.load_func(fn_name, BPF.KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI)
            return self.bpf.load_func(fn_name, BPF.KPROBE)

    def attach(self, fn_name, path, offset: int, retprobe: bool = False, pid: int = -1) -> Handle:
        """Run program fn_name at file offset `offset` of path (at return with retprobe), in process pid
        only (a tgid for multi links: the kernel filters by process; a thread id for perf) or in all.
        Raises AttachError."""
        fn = fn_name.encode() if isinstance(fn_name, str) else fn_name
        p = path.encode() if isinstance(path, str) else path
        if self.mode == MULTI:
            fd, err = _link_create(self._func(fn).fd, p, offset, retprobe, pid)
            if fd < 0:
                raise AttachError(err, f"uprobe_multi link: {why(err)}")
            return Handle(fd=fd)
        try:  # bcc names the event after the path as it resolves it (for a pid: through that process)
            rp, raddr = self.bpf._check_path_symbol(p, b"", offset, pid)
        except Exception as e:
            raise AttachError(errno.ENOENT, f"perf uprobe: {e}") from None
        ev = self.bpf._get_uprobe_evname(b"r" if retprobe else b"p", rp, raddr, pid)
        if ev in self.bpf.uprobe_fds:  # one left over from a failed detach: bcc would drop its fd
            self.bpf.detach_uprobe_event(ev)
        r = _bcc_attach_uprobe()(self._func(fn).fd, int(retprobe), ev, rp, raddr, pid, 0)
        if r < 0:
            err = ctypes.get_errno()
            raise AttachError(err, f"perf uprobe at {rp.decode(errors='replace')}+0x{raddr:x}: {why(err)}")
        self.bpf._add_uprobe_fd(ev, r)
        return Handle(ev=ev)

    def detach(self, h: Handle) -> None:
        """Close it; never raises (a perf event already gone with its fd is fine)."""
        if h.fd >= 0:
            fd, h.fd = h.fd, -1
            try:
                os.close(fd)  # the last reference: the kernel unregisters the uprobe
            except OSError:
                pass
        elif h.ev:
            ev, h.ev = h.ev, b""
            try:
                self.bpf.detach_uprobe_event(ev)
            except Exception:
                pass


_bcc_fn = None


def _bcc_attach_uprobe():
    """libbcc's bpf_attach_uprobe(progfd, type, ev_name, path, offset, pid, ref_ctr_offset). Debian's bcc
    0.26 Python declares and passes the first 6 only, so the 7th is whatever the stack holds: a uprobe
    with a stray ref_ctr_offset, which the kernel refuses (EINVAL, dmesg "ref_ctr_offset mismatch")
    where another uprobe on the same offset has none. Our own function object, with all 7."""
    global _bcc_fn
    if _bcc_fn is None:
        f = ctypes.CDLL("libbcc.so.0", use_errno=True).bpf_attach_uprobe
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulonglong,
                      ctypes.c_int, ctypes.c_uint32]
        _bcc_fn = f
    return _bcc_fn


_objs_lock = threading.Lock()


def attacher_for(bpf, mode: str | None = None) -> UprobeAttacher:
    """The BPF object's attacher, made on first use (mode: PERF forces the fallback; only before the
    object's first attach)."""
    with _objs_lock:
        a = getattr(bpf, "_mcp_uprobes", None)
        if a is None:
            a = UprobeAttacher(bpf, mode)
            bpf._mcp_uprobes = a
        elif mode and mode != a.mode:
            raise ValueError(f"uprobes of this BPF object are already {a.mode}")
        return a
