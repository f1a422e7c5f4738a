"""CUDA driver calls and NVIDIA ioctls: find every libcuda.so, attach per inode, keep within a budget.

Hooks (bpf/cuda.bpf.c): uprobes on libcuda.so exports; its own programs on syscalls:sys_enter_ioctl /
sys_exit_ioctl and sched:sched_process_exit (attached here by fd, not through bcc's attach_tracepoint,
whose table is keyed by tracepoint name and would lose the marker's fd); sched:sched_process_exec
(attached by the loader, drained here from map cu_exec).

Libraries. A process's libcuda is whatever /proc/PID/maps says it maps; in a container that is another
file, another inode, reached through /proc/PID/root/<path> (or /proc/PID/map_files/<range> when the
path is gone). Uprobes bind to the inode, so they are attached once per (device, inode) and also fire in
every process that maps that inode later; a new inode is found by rereading the maps of processes that
exec (soon after the exec and again while they may still dlopen it) and of every process every
`rescan_s`. A library whose processes have all gone is detached. A symbol a library lacks is missing
for that library only, with its reason (symbol_rows(), the probe table).

NVIDIA fds. The kernel counts ioctls on fds listed in map nv_fds, which this module keeps from
/proc/PID/fd of watched processes every `fd_scan_s`. Not the ioctl type byte: on the H200 host
nvidia-uvm's commands are bare numbers (type 0x00) and /dev/nvidiactl and /dev/nvidiaN share type
'F' with no device told apart; not fd -> file in BPF either, which would read kernel structs. An fd
opened and used between two scans is missed; a closed fd whose number is reused within a scan is
counted as NVIDIA's until the next. `device_globs` says what is NVIDIA's (tests register a file).

Overhead governor. When the first libcuda appears, calibrate_standin() times a function of the
agent's own that starts with the same first instruction as that library's cuLaunchKernel (read from
the file, never loaded: a library a process maps may be anyone's), with and without our launch program
attached (per-hit cost, trap included; the trap's cost depends on the probed instruction: 7.4 us on
libc's labs() vs ~1.1 us on cuLaunchKernel in the H200 VM). Every control window the launch rate of each process is estimated per
symbol from the (scaled) counts, and host-wide for processes not watched (as one process); when the
busiest process's rate x cost exceeds the budget, each busy cuLaunchKernel* symbol gets a weight k:
its probe is attached 1/k of the time and each hit counts k (the kernel reads cu_config), the counters
marked `sampled`. A symbol that is hardly called costs nothing and stays attached and exact.
Each (library, symbol) keeps an on-time credit: it earns 1/k per second, spends 1 per second while
attached; the probe goes on when a slice's worth is owed and off when the credit is spent. So a slow
detach (a perf-event uprobe waits out an RCU-tasks grace period, ~0.1-0.2 s in these VMs, serialised by
the kernel; a uprobe_multi link a few ms) lengthens the next off-time instead of biasing the count, and
a weight change carries the credit over.
Each attach traps for its own duration (~10 ms) before the program counts: the weights are chosen for
the budget less that share of a slice.
The scaled counts assume the probe does not change the launch rate; a launch-bound thread runs slower
while attached, so its count is low by about its on-slice overhead share (governor_status()
`attached_overhead`).

Uprobes are attached one per (symbol, entry|return) through agent/uprobes.py: BPF uprobe_multi links
on Linux 6.6+ (released within milliseconds), bcc's perf-event uprobes otherwise.

Threads: two of its own (start()): the finder (maps, fds, exec, control) and the duty cycler, apart
because the slices need timing that neither the pipeline's poll loop nor a finder pass that detaches a
library (one grace period per probe) can give; service() does both where a caller owns the loop.
"""

from __future__ import annotations

import ctypes
import fnmatch
import math
import os
import re
import statistics
import threading
from concurrent.futures import ThreadPoolExecutor
import time
from dataclasses import dataclass, field

from . import libtrust
from ..core import procscan
from ..core import records as R
from . import uprobes
from ..core.decode import Counters, DecodeError, Header, counters_from
from ..core.probes import ATTACHED, MISSING, ProbePlan

TRACEFS = "/sys/kernel/tracing"
MAX_REFUSED_KEPT = 1024  # refused (device, inode)s remembered, so each is checked once
CAP_REASON = "cuda.max_libraries"
# A user controls what their processes' maps cost to read (60,000 mappings: ~30 ms each): a pass over
# /proc spends at most RESCAN_BUDGET_S, one every RESCAN_PASS_S while a round lasts (<= 10% of a core);
# the exec checks get the same budget per RESCAN_PASS_S of their own.
RESCAN_BUDGET_S = 0.025
RESCAN_PASS_S = 0.25
MAX_REFUSED_ROWS = 32  # of them in `mcp-agent probes` and symbol_rows(): the latest
LAUNCH_FIELDS = ("cu_launch", "cu_launch_ptsz", "cu_launch_ex", "cu_launch_ex_ptsz")


@dataclass(frozen=True)
class Sym:
    name: str
    probe: str  # row in probes.PROBES
    entry: str  # BPF function run at entry
    ret: str | None = None  # BPF function run at return (latency pairs)


SYMBOLS = (
    # entry function = counter field = weight slot of the duty-cycled ones (LAUNCH_CFG)
    Sym("cuLaunchKernel", "cuda_launch", "cu_launch"),
    Sym("cuLaunchKernel_ptsz", "cuda_launch", "cu_launch_ptsz"),
    Sym("cuLaunchKernelEx", "cuda_launch", "cu_launch_ex"),  # cuBLAS launches through it
    Sym("cuLaunchKernelEx_ptsz", "cuda_launch", "cu_launch_ex_ptsz"),
    Sym("cuGraphLaunch", "cuda_graph", "cu_graph_launch"),  # one per replay, not per kernel
    Sym("cuGraphLaunch_ptsz", "cuda_graph", "cu_graph_launch"),
    Sym("cuCtxPushCurrent", "cuda_ctx", "cu_ctx_enter", "cu_ctx_ret"),
    Sym("cuCtxPushCurrent_v2", "cuda_ctx", "cu_ctx_enter", "cu_ctx_ret"),
    Sym("cuCtxPopCurrent", "cuda_ctx", "cu_ctx_enter", "cu_ctx_ret"),
    Sym("cuCtxPopCurrent_v2", "cuda_ctx", "cu_ctx_enter", "cu_ctx_ret"),
    Sym("cuCtxSetCurrent", "cuda_ctx", "cu_ctx_enter", "cu_ctx_ret"),
    Sym("cuStreamSynchronize", "cuda_sync", "cu_sync_stream_enter", "cu_sync_ret"),
    Sym("cuStreamSynchronize_ptsz", "cuda_sync", "cu_sync_stream_enter", "cu_sync_ret"),
    Sym("cuCtxSynchronize", "cuda_sync", "cu_sync_ctx_enter", "cu_sync_ret"),
    Sym("cuCtxSynchronize_v2", "cuda_sync", "cu_sync_ctx_enter", "cu_sync_ret"),  # driver 580 exports it
    Sym("cuEventSynchronize", "cuda_sync", "cu_sync_event_enter", "cu_sync_ret"),
    Sym("cuMemAlloc_v2", "cuda_alloc", "cu_alloc_enter", "cu_alloc_ret"),
    Sym("cuMemAllocAsync", "cuda_alloc", "cu_alloc_enter", "cu_alloc_ret"),
    Sym("cuMemAllocAsync_ptsz", "cuda_alloc", "cu_alloc_enter", "cu_alloc_ret"),
    Sym("cuMemFree_v2", "cuda_free", "cu_free_enter", "cu_free_ret"),
    Sym("cuMemFreeAsync", "cuda_free", "cu_free_enter", "cu_free_ret"),  # the stream-ordered allocator's
    Sym("cuMemFreeAsync_ptsz", "cuda_free", "cu_free_enter", "cu_free_ret"),
)
DUTY_PROBE = "cuda_launch"  # the high-rate ones; the rest are a few per step
LAUNCH_CFG = {f: R.C["MCP_CFG_WEIGHT_" + f[3:].upper()] for f in LAUNCH_FIELDS}
UPROBE_ROWS = tuple(dict.fromkeys(s.probe for s in SYMBOLS))

# ---- zero-touch GPU steps: ring-buffer record MCP_EV_GPU_STEP (pure decode) ----
EV_GPU_STEP = R.C["MCP_EV_GPU_STEP"]


@dataclass(frozen=True)
class GpuStep:
    hdr: Header  # the thread; hdr.ts_ns is the closing sync's return
    begin_ns: int  # previous sync return on the thread, or its first counted CUDA call
    sync_ns: int
    sync_kind: str  # "stream" | "ctx" | "event"
    counters: Counters  # cu_* and nv_* over the step, closing sync included

    @property
    def launches(self) -> int:
        c = self.counters
        return sum(getattr(c, f) for f in LAUNCH_FIELDS)


def decode_step(raw: bytes) -> GpuStep:
    size = ctypes.sizeof(R.EvGpuStep)
    if len(raw) < size:
        raise DecodeError("short", f"gpu step: {len(raw)} bytes, layout {size}")
    rec = R.EvGpuStep.from_buffer_copy(raw[:size])
    h = rec.h
    if h.type != EV_GPU_STEP or h.size != size:
        raise DecodeError("bad_size", f"gpu step: type {h.type} size {h.size}, layout {size}")
    kind = R.SYNC_KINDS.get(rec.sync_kind)
    if kind is None:
        raise DecodeError("bad_field", f"sync kind {rec.sync_kind}")
    hdr = Header(h.type, h.tgid, h.tid, h.cpu, h.ts_ns, h.cgroup_id, bytes(h.comm).split(b"\0", 1)[0])
    return GpuStep(hdr, rec.begin_ns, rec.sync_ns, kind, counters_from(rec.c))


# ---- span findings (pure) ----
# Shares of a request's wall time past which its span gets a finding. A context push costs 8-15 us
# (the seeds' measurement): 5% of a 10 ms request is ~40 of them. A request mostly waiting in sync calls
# is GPU-bound, not host-bound: worth saying, not an error.
FINDING_SHARES = {"cuda.ctx_switch_heavy": ("cu_ctx_ns", 0.05), "cuda.sync_bound": ("cu_sync_ns", 0.5),
                  "nvidia.ioctl_heavy": ("nv_ioctl_ns", 0.1)}


def findings(c: Counters, duration_ns: int) -> dict[str, float]:
    """{finding: share of the request} for each share over its threshold (FINDING_SHARES)."""
    if duration_ns <= 0:
        return {}
    out = {}
    for name, (field_, share) in FINDING_SHARES.items():
        v = getattr(c, field_) / duration_ns
        if v >= share:
            out[name] = round(v, 4)
    return out


# ---- /proc parsing (pure) ----
_LIBCUDA = re.compile(r"(^|/)libcuda\.so(\.\d+)*$")


@dataclass(frozen=True)
class Mapping:
    start: str  # "7f..-7f.." range, for /proc/PID/map_files
    dev: tuple[int, int]  # (major, minor) as maps shows it
    inode: int
    path: str
    deleted: bool


def libcuda_mappings(maps: str) -> list[Mapping]:
    """The libcuda.so* file mappings in a /proc/PID/maps text, one per (device, inode)."""
    out: dict[tuple, Mapping] = {}
    if "libcuda.so" not in maps:
        return []
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or "libcuda.so" not in parts[5]:
            continue
        path, deleted = parts[5], parts[5].endswith(" (deleted)")
        if deleted:
            path = path[: -len(" (deleted)")]
        if not _LIBCUDA.search(path):
            continue
        major, minor = (int(x, 16) for x in parts[3].split(":"))
        key = (major, minor, int(parts[4]))
        out.setdefault(key, Mapping(parts[0], (major, minor), int(parts[4]), path, deleted))
    return list(out.values())


def syscall_layout_ok(tracefs: str = TRACEFS) -> str | None:
    """None when sys_enter_ioctl has fd at 16 and cmd at 24 (struct mcp_sys_enter_ioctl), else why not."""
    want = {"fd": 16, "cmd": 24}
    try:
        with open(f"{tracefs}/events/syscalls/sys_enter_ioctl/format") as f:
            text = f.read()
    except OSError as e:
        return f"tracepoint syscalls:sys_enter_ioctl not readable: {e.strerror}"
    for name, off in want.items():
        m = re.search(rf"field:[^;]*\b{name};\s*offset:(\d+);", text)
        if not m or int(m.group(1)) != off:
            return f"sys_enter_ioctl field {name} not at offset {off} (cuda.bpf.c's struct mcp_sys_enter_ioctl)"
    return None


def plan_weights(rates: dict[int, dict[str, float]], cost_ns: float, budget: float,
                 current: dict[str, int] | None = None, max_weight: int = 1000) -> dict[str, int]:
    """Weights per launch symbol so that every process's probe overhead stays within budget.

    rates: pid -> launch symbol -> hits/s (estimates of the true rate). A symbol is busy when some
    process calls it at a cost of at least budget/8; busy symbols share one weight k, chosen for the
    busiest process: k = its busy overhead / (budget - its overhead from the exact ones). The weight goes
    up at once and down only with 50% headroom, so that it does not flap at the edge."""
    current = current or {}
    c = cost_ns * 1e-9
    busy = {f for f in LAUNCH_FIELDS if any(r.get(f, 0.0) * c >= budget / 8 for r in rates.values())}
    need = 0.0
    for r in rates.values():
        duty = sum(r.get(f, 0.0) for f in busy) * c
        exact = sum(r.get(f, 0.0) for f in LAUNCH_FIELDS if f not in busy) * c
        need = max(need, duty / max(budget - exact, budget / 8))
    k = max(1, min(max_weight, math.ceil(need - 1e-9)))
    held = max((current.get(f, 1) for f in busy), default=1)
    if k < held and math.ceil(need * 1.5 - 1e-9) >= held:
        k = held
    return {f: (k if f in busy else 1) for f in LAUNCH_FIELDS}


# ---- state ----
@dataclass
class SymState:
    sym: Sym
    addr: int | None = None
    state: str = "pending"  # attached | missing | alias | disabled
    reason: str = ""
    events: list[uprobes.Handle] = field(default_factory=list)  # entry (and return) uprobe, while attached
    on_since: float | None = None
    attached_s: float = 0.0  # cumulative, for reporting
    credit: float = 0.0  # duty cycle: on-time owed (s)
    last_t: float = 0.0


@dataclass
class Library:
    key: tuple[int, int, int]  # (major, minor, inode) from maps
    path: str  # what bcc and the kernel open
    shown: str  # the path inside the process's mount namespace
    pids: set[int] = field(default_factory=set)
    syms: dict[str, SymState] = field(default_factory=dict)
    start: str = ""  # the mapping's range, for /proc/PID/map_files
    dropped: bool = False
    fd: int = -1  # the checked file, held open: `path` is /proc/self/fd/<fd> (CudaProbes._pin)


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


def _close(lib_: Library) -> None:
    if lib_.fd >= 0:
        os.close(lib_.fd)
        lib_.fd = -1


class CudaProbes:
    """Attach, follow and govern the CUDA probes of one compiled unit (bcc BPF object).

        cp = CudaProbes(bpf, plan, budget=0.02, auto_watch=cfg.process_watch == "gpu")
        cp.start()            # attaches, calibrates, starts its thread
        cp.governor_status(); cp.symbol_rows(); cp.ioctl_rows(); cp.hist_rows()
        cp.stop()             # before bpf.cleanup()
    """

    def __init__(self, bpf, plan: ProbePlan, budget: float = 0.02, auto_watch: bool = True,
                 device_globs=("/dev/nvidia*",), slice_s: float = 0.2, control_s: float = 1.0,
                 rescan_s: float = 10.0, fd_scan_s: float = 1.0, max_call_s: float = 3600.0,
                 governor: bool = True, proc_root: str = "/proc", keep_exited_s: float = 30.0,
                 attach_uprobes: bool = True, uprobe_mode: str | None = None, max_libraries: int = 16):
        self.bpf, self.plan = bpf, plan
        self.budget, self.auto_watch = budget, auto_watch
        self.device_globs = tuple(device_globs)
        self.slice_s, self.control_s, self.rescan_s, self.fd_scan_s = slice_s, control_s, rescan_s, fd_scan_s
        self.max_call_s, self.governor, self.proc = max_call_s, governor, proc_root
        self.keep_exited_s = keep_exited_s
        self.attach_uprobes = attach_uprobes  # False: find libraries and symbols only (`mcp-agent probes`)
        # the mechanism, fixed per BPF object before any of its uprobe programs is loaded (uprobes.py);
        # deciding loads only the feature probe's 2-instruction program, none of ours
        self._up = uprobes.attacher_for(bpf, uprobe_mode)
        self.libs: dict[tuple, Library] = {}
        self.max_libraries = max_libraries
        self.refused: dict[tuple, tuple[str, str]] = {}  # (major, minor, inode) -> (path shown, why)
        self.refused_total = 0  # distinct files refused since start (mcp.agent.records.rejected)
        self.enabled = {n for n in UPROBE_ROWS + ("nvidia_ioctl", "cuda_thread_exit", "cuda_exec")
                        if n in plan.statuses and plan.statuses[n].state == ATTACHED}
        self.weights = {f: 1 for f in LAUNCH_FIELDS}
        self.paused = False
        self.calibration: Calibration | None = None
        self.rates: dict[int, dict[str, float]] = {}
        self.unsteered = 0  # processes with launch rates that may not steer the weights (last window)
        self.toggles = 0
        self.attach_s = 0.01  # an attach call's duration (moving average): the probe traps, not yet counting
        self.errors: list[str] = []
        self.error_count = 0  # failed service passes, all of them (errors keeps the last 20 texts)
        self._rows: list[dict] = []
        self._lock = threading.RLock()  # libraries, fds (the finder's)
        self._duty_lock = threading.RLock()  # launch probes' attach state (the duty cycler's)
        self._targets: list[tuple[Library, SymState]] = []  # launch probes, replaced whole on change
        self._dead: set[tuple] = set()
        self._stop = threading.Event()
        self._wake = threading.Event()  # the duty cycler's turns changed (weights, pause, new probes)
        self._threads: list[threading.Thread] = []
        self._tp_fds: list[int] = []
        self._exec_checks: dict[int, list[float]] = {}
        self._exec_window, self._exec_spent = 0.0, 0.0  # exec checks' budget window: start, seconds spent
        self._walker = procscan.Walker(proc_root, RESCAN_BUDGET_S, self._stop)
        self._seen: dict[tuple, set[int]] = {}  # the walk's round so far: library -> pids mapping it
        self._next = {"exec": 0.0, "rescan": 0.0, "fds": 0.0, "control": 0.0}
        self._fds: dict[int, dict[int, int]] = {}  # tgid -> fd -> device id
        self._dev_ids: dict[str, int] = {}
        self._gone: dict[int, float] = {}  # tgid -> when first seen gone
        self._ctl_prev: tuple[float, int, dict[int, dict[str, int]]] | None = None

    @property
    def weight(self) -> int:
        return max(self.weights.values())

    # ---- lifecycle ----
    def start(self, thread: bool = True, calibrate_target=None) -> None:
        """Configure the kernel side, attach the tracepoint programs, scan, calibrate, then run."""
        for idx in LAUNCH_CFG.values():
            self._set_cfg(idx, 1)
        self._set_cfg(R.C["MCP_CFG_AUTO_WATCH"], int(self.auto_watch))
        self._set_cfg(R.C["MCP_CFG_MAX_CALL_NS"], int(self.max_call_s * 1e9))
        self.set_tracepoints(True)
        for name in UPROBE_ROWS:
            if name in self.enabled:
                self.plan.mark(name, ATTACHED, "armed: attached per libcuda.so inode as processes map it; none yet")
        if self.governor and DUTY_PROBE in self.enabled and calibrate_target is not None:
            self.calibration = calibrate(self.bpf, target=calibrate_target)
        self.service()
        if thread:
            self._threads = [threading.Thread(target=self._run, args=(self.service_finder, self._stop),
                                              name="mcp-cuda", daemon=True),
                             threading.Thread(target=self._run, args=(self.service_duty, self._wake),
                                              name="mcp-cuda-duty", daemon=True)]
            for t in self._threads:
                t.start()

    def stop(self) -> None:
        """Stop the threads, detach every uprobe and our tracepoint programs (call before bpf.cleanup()).
        A perf-event uprobe's detach waits an RCU-tasks grace period (~0.13 s here): they run in parallel."""
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(30)
        with self._lock, self._duty_lock:
            self._detach_all([st for lib_ in self.libs.values() for st in lib_.syms.values()])
            self.set_tracepoints(False)
            for lib_ in self.libs.values():
                _close(lib_)

    def set_tracepoints(self, on: bool) -> None:
        """Attach (or close) our own tracepoint programs: benchmarks toggle them with the loader's."""
        from bcc import lib

        for fd in self._tp_fds:
            lib.bpf_close_perf_event_fd(fd)
        self._tp_fds = []
        if not on:
            return
        if "nvidia_ioctl" in self.enabled:
            why = syscall_layout_ok()
            if why:
                self.plan.mark("nvidia_ioctl", MISSING, why, "file an issue with this kernel's format file")
            else:
                self._attach_tp("nvidia_ioctl", [("syscalls", "sys_enter_ioctl", "nv_ioctl_enter"),
                                                 ("syscalls", "sys_exit_ioctl", "nv_ioctl_exit")])
        if "cuda_thread_exit" in self.enabled:
            self._attach_tp("cuda_thread_exit", [("sched", "sched_process_exit", "cuda_thread_exit")])

    def _run(self, step, wake: threading.Event) -> None:
        while not self._stop.is_set():
            try:
                wait = step()
            except Exception as e:  # keep following; the error is reported, not fatal
                self.error_count += 1
                self.errors = (self.errors + [f"{type(e).__name__}: {e}"])[-20:]
                wait = 0.5
            wake.wait(max(0.002, wait))
            if wake is self._wake:
                wake.clear()

    def service(self) -> float:
        """Everything that is due (for a caller that owns the loop); seconds until the next thing is."""
        return min(self.service_finder(), self.service_duty())

    def service_duty(self) -> float:
        """The duty cycle's turns. Its own thread: a finder pass that detaches a library waits out one RCU
        grace period per probe (seconds for a library), and a launch probe left on meanwhile would bias
        the counts of the window it falls in."""
        return self._duty(time.monotonic()) - time.monotonic()

    def service_finder(self) -> float:
        """Libraries, NVIDIA fds, exec'd processes, the governor's control; seconds until the next is due."""
        with self._lock:
            now = time.monotonic()
            for key in list(self._dead):
                self._dead.discard(key)
                if key in self.libs:
                    self._drop(self.libs[key])
            if now >= self._next["exec"]:
                self._drain_exec(now)
                self._next["exec"] = now + 0.05
            # any user can exec at will, and this runs every 50 ms: the checks get RESCAN_BUDGET_S of
            # /proc reading per RESCAN_PASS_S window, as the rescan does; the rest wait their turn
            if now >= self._exec_window + RESCAN_PASS_S:
                self._exec_window, self._exec_spent = now, 0.0
            for pid in [p for p, ts in self._exec_checks.items() if ts[0] <= now]:
                if self._exec_spent >= RESCAN_BUDGET_S or self._stop.is_set():
                    break
                self._exec_checks[pid].pop(0)
                if not self._exec_checks[pid]:
                    del self._exec_checks[pid]
                t0 = time.monotonic()
                self.scan_pid(pid)
                self._exec_spent += time.monotonic() - t0
            if now >= self._next["rescan"]:
                if self.rescan():
                    self._sweep_exited(now)
                    self._next["rescan"] = now + self.rescan_s
                else:  # a round cut by its budget goes on soon, at a bounded share of a core
                    self._next["rescan"] = now + RESCAN_PASS_S
            if now >= self._next["fds"]:
                self.scan_fds()
                self._next["fds"] = now + self.fd_scan_s
            if self.governor and not self.paused and now >= self._next["control"]:
                self._control(now)
                # a window of several duty cycles, or the rates it sees depend on the cycle's phase
                self._next["control"] = now + max(self.control_s, 3 * self.weight * self.slice_s)
            self._rows = self._symbol_rows()
            return min(t for k, t in self._next.items() if k != "control" or self.governor) - time.monotonic()

    # ---- kernel plumbing ----
    def _set_cfg(self, idx: int, value: int) -> None:
        self.bpf[b"cu_config"][ctypes.c_int(idx)] = ctypes.c_uint64(value)

    def _attach_tp(self, row: str, tps) -> None:
        from bcc import BPF, lib

        fds = []
        for cat, ev, fn in tps:
            if not os.path.exists(f"{TRACEFS}/events/{cat}/{ev}"):
                reason = f"tracepoint {cat}:{ev} not in this kernel's tracefs"
            else:
                f = self.bpf.load_func(fn.encode(), BPF.TRACEPOINT)
                fd = lib.bpf_attach_tracepoint(f.fd, cat.encode(), ev.encode())
                if fd >= 0:
                    fds.append(fd)
                    continue
                reason = f"attach {fn} to {cat}:{ev}: {os.strerror(ctypes.get_errno() or 22)}"
            for fd in fds:
                lib.bpf_close_perf_event_fd(fd)
            self.plan.mark(row, MISSING, reason)
            return
        self._tp_fds += fds
        self.plan.mark(row, ATTACHED, "")

    def _attach(self, lib_: Library, st: SymState) -> None:
        """Attach st's entry (and return) program at its address; both or neither."""
        hs = []
        try:
            hs.append(self._up.attach(st.sym.entry, lib_.path, st.addr))
            if st.sym.ret:
                hs.append(self._up.attach(st.sym.ret, lib_.path, st.addr, retprobe=True))
        except Exception:
            for h in hs:
                self._up.detach(h)
            raise
        st.events = hs
        st.on_since = time.monotonic()  # counting starts when the program is set on the probe

    def _detach(self, st: SymState) -> None:
        if st.on_since is not None:
            st.attached_s += time.monotonic() - st.on_since
            st.on_since = None
        for h in st.events:
            self._up.detach(h)
        st.events = []

    def _detach_all(self, sts: list[SymState]) -> None:
        """Detach in parallel: each release waits for the kernel (a perf-event uprobe its own RCU-tasks
        grace period, ~0.1 s: a process's ~40 took ~5 s one by one, the whole shutdown budget; a
        uprobe_multi link ~25 ms) and parallel ones share the wait. ctypes and os.close drop the GIL."""
        sts = [st for st in sts if st.events]
        if len(sts) <= 1:
            for st in sts:
                self._detach(st)
            return
        with ThreadPoolExecutor(max_workers=min(32, len(sts))) as pool:
            list(pool.map(self._detach, sts))

    # ---- finding libraries ----
    def _drain_exec(self, now: float) -> None:
        table = self.bpf[b"cu_exec"]
        # a process that execs may dlopen libcuda seconds later (framework import, lazy CUDA init)
        for k in list(table.keys()):
            table.pop(k, None)
            if len(self._exec_checks) < 4096:
                self._exec_checks[k.value] = [now + d for d in (0.05, 0.3, 1, 3, 10, 30)]

    def scan_pid(self, pid: int) -> list[Library]:
        """Read one process's maps; attach any libcuda inode not yet attached. Returns its libraries."""
        out = []
        for m in libcuda_mappings(procscan.read_maps(pid, self.proc).decode(errors="replace")):
            key = (*m.dev, m.inode)
            with self._lock:
                lib_ = self.libs.get(key) or self._new_library(pid, m)
                if lib_ is not None:
                    lib_.pids.add(pid)
                    out.append(lib_)
        return out

    def rescan(self, full: bool = False) -> bool:
        """One pass of the walk over every process's maps (procscan.Walker: RESCAN_BUDGET_S of wall time,
        resumed at the next pass; full: passes until the round ends): new libraries attached, and at the
        end of a round, libraries that no process mapped during it detached. True when a round ended."""
        while True:
            done = self._walker.walk(self._rescan_visit)
            if done or not full or self._stop.is_set():
                break
        if done:
            seen, self._seen = self._seen, {}
            with self._lock:
                for key, lib_ in list(self.libs.items()):
                    lib_.pids = seen.get(key, set())
                    if not lib_.pids:
                        self._drop(lib_)
                self._update_rows()
        return done

    def _rescan_visit(self, pid: int) -> None:
        for lib_ in self.scan_pid(pid):
            self._seen.setdefault(lib_.key, set()).add(pid)

    def _drop(self, lib_: Library) -> None:
        lib_.dropped = True
        self.libs.pop(lib_.key, None)
        for key in [k for k, (_, why) in self.refused.items() if why.startswith(CAP_REASON)]:
            del self.refused[key]  # room again: the next scan may follow them
        self._update_rows()
        with self._duty_lock:
            self._detach_all(list(lib_.syms.values()))
        _close(lib_)

    @staticmethod
    def _pin(path: str, key: tuple) -> int:
        """An fd of the file just checked at path, verified to be that (device, inode): symbols are
        read and uprobes attached through /proc/self/fd/<fd> from here on, so a user who swaps what
        the path names after the check (a mount in their own namespace, a remapped range behind
        map_files) changes nothing the agent reads. O_NOFOLLOW but for map_files, whose entries
        are the kernel's links to the mapped file."""
        flags = os.O_RDONLY | os.O_CLOEXEC | (0 if "/map_files/" in path else os.O_NOFOLLOW)
        fd = os.open(path, flags)
        st = os.fstat(fd)
        if (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) != tuple(key):
            os.close(fd)
            raise libtrust.Untrusted(f"{path}: not the file the process maps (replaced since the check)")
        return fd

    def _resolve(self, pid: int, m: Mapping) -> str | None:
        """A path to the mapped file, to check and then _pin: the agent's own view of the path when it
        is the same file (the host's libcuda), else through the process's root, else map_files (a
        deleted file, or overlayfs showing another inode). Raises libtrust.Untrusted for a file that
        a user other than root could have written (agent/libtrust.py)."""
        if not m.deleted:
            for root in ("/", f"{self.proc}/{pid}/root"):
                c = m.path if root == "/" else root + m.path
                try:
                    st = os.stat(c)
                except OSError:
                    continue
                if st.st_ino == m.inode and (os.major(st.st_dev), os.minor(st.st_dev)) == m.dev:
                    libtrust.check_path(root, m.path, m.dev, m.inode)
                    return c
        c = f"{self.proc}/{pid}/map_files/{m.start}"
        if not os.path.exists(c):
            return None
        libtrust.check_open_file(c, m.path, m.dev, m.inode)
        return c

    def _refuse(self, key: tuple, shown: str, why: str) -> None:
        """Remember a refused file (bounded: a user can make inodes without end) and count it."""
        if key not in self.refused:
            self.refused_total += 1
            if len(self.refused) >= MAX_REFUSED_KEPT:
                self.refused.pop(next(iter(self.refused)))
            self.refused[key] = (shown, why)
            if len(self.errors) < 20 or self.refused_total % 1000 == 1:
                self.errors = (self.errors + [f"refused {shown}: {why}"])[-20:]
            self._update_rows()

    def _new_library(self, pid: int, m: Mapping) -> Library | None:
        from bcc import BPF

        key = (*m.dev, m.inode)
        if key in self.refused:
            return None
        shown = m.path + (" (deleted)" if m.deleted else "")
        try:
            path = self._resolve(pid, m)
        except libtrust.Untrusted as e:
            self._refuse(key, shown, f"not trusted: {e}")
            return None
        if path is None:
            return None
        if len(self.libs) >= self.max_libraries:
            self._refuse(key, shown, f"{CAP_REASON} ({self.max_libraries}) files followed already")
            return None
        try:
            fd = self._pin(path, key)
        except libtrust.Untrusted as e:
            self._refuse(key, shown, f"not trusted: {e}")
            return None
        except OSError:  # gone meanwhile: the next scan tries again
            return None
        lib_ = Library(key, f"/proc/self/fd/{fd}", shown, start=m.start, fd=fd)
        if self.calibration is None and self.governor and DUTY_PROBE in self.enabled and self.attach_uprobes:
            self._calibrate(lib_)
        by_addr: dict[int, str] = {}
        now = time.monotonic()
        for sym in SYMBOLS:
            st = lib_.syms[sym.name] = SymState(sym, last_t=now)
            if sym.probe not in self.enabled:
                st.state, st.reason = "disabled", f"probe {sym.probe} disabled or missing"
                continue
            try:
                st.addr = BPF._check_path_symbol(lib_.path.encode(), sym.name.encode(), None, -1)[1]
            except Exception:
                st.state, st.reason = "missing", f"{sym.name} not exported by {lib_.shown}"
                continue
            if st.addr in by_addr:  # one address, one probe: an alias would count twice
                st.state, st.reason = "alias", f"same address as {by_addr[st.addr]}"
                continue
            by_addr[st.addr] = sym.name
            st.state = "attached" if self.attach_uprobes else "found"
            if sym.probe == DUTY_PROBE or not self.attach_uprobes:
                continue  # the duty cycler attaches it, now if exact, else in its turn
            try:
                self._attach(lib_, st)
            except Exception as e:
                st.state, st.reason = "missing", f"attach uprobe {sym.name} in {lib_.shown}: {e}"
        self.libs[lib_.key] = lib_
        self._update_rows()
        return lib_

    def _update_rows(self) -> None:
        """Probe table rows: attached while any library has one of its symbols, with the misses named.
        Also the duty cycler's list of launch probes."""
        self._targets = [(lib_, st) for lib_ in self.libs.values() for st in lib_.syms.values()
                         if st.sym.probe == DUTY_PROBE and st.addr is not None and st.state != "alias"]
        self._wake.set()
        for row in UPROBE_ROWS:
            if row not in self.enabled:
                continue
            sts = [st for lib_ in self.libs.values() for st in lib_.syms.values() if st.sym.probe == row]
            if not sts:
                continue
            ok = [s for s in sts if s.state in ("attached", "alias", "found")]
            misses = sorted({s.reason for s in sts if s.state == "missing"})
            detail = f"{len(self.libs)} libcuda file(s)" + (f"; {'; '.join(misses)}" if misses else "")
            if self.refused_total:
                detail += f"; {self.refused_total} refused (not root's, or cuda.max_libraries)"
            if row == DUTY_PROBE and self.weight > 1:
                detail += f"; duty cycle 1/{self.weight} (budget {self.budget:.1%})"
            self.plan.mark(row, ATTACHED if ok else MISSING, detail,
                           "" if ok else "this driver lacks these symbols (symbol_rows() lists them)")

    def _calibrate(self, lib_: Library) -> None:
        """The per-hit cost on this host, measured on the agent's stand-in for the first library's
        cuLaunchKernel before its launch probes are attached (calibrate_standin); else on libc's labs()
        in this process; else a conservative default (the trap floor of docs/machines.md)."""
        for t in (lambda: calibrate_standin(self.bpf, lib_.path, name=os.path.basename(lib_.shown)),
                  lambda: calibrate(self.bpf)):
            try:
                self.calibration = t()
                return
            except Exception as e:
                self.errors.append(f"calibrate: {type(e).__name__}: {e}")
        self.calibration = Calibration(12_000.0, 0.0, "default (calibration failed)", 0)

    # ---- NVIDIA fds ----
    def _device_id(self, path: str) -> int:
        if path not in self._dev_ids:
            self._dev_ids[path] = len(self._dev_ids) + 1
        return self._dev_ids[path]

    def scan_fds(self, pids=None) -> None:
        """Refresh nv_fds for watched processes and those mapping libcuda; purge long-gone processes."""
        if "nvidia_ioctl" not in self.enabled and pids is None:
            return
        table = self.bpf[b"nv_fds"]
        if pids is None:
            pids = {k.value for k in self.bpf[b"watch_tgid"].keys()}
            pids |= {p for lib_ in self.libs.values() for p in lib_.pids}
        now = time.monotonic()
        for pid in set(pids) | set(self._fds):
            want: dict[int, int] = {}
            try:
                for fd in os.listdir(f"{self.proc}/{pid}/fd"):
                    try:
                        target = os.readlink(f"{self.proc}/{pid}/fd/{fd}")
                    except OSError:
                        continue
                    if any(fnmatch.fnmatchcase(target, g) for g in self.device_globs):
                        want[int(fd)] = self._device_id(target)
                self._gone.pop(pid, None)
            except OSError:
                self._gone.setdefault(pid, now)
            have = self._fds.get(pid, {})
            for fd in have.keys() - want.keys():
                table.pop(R.NvFdKey(pid, fd), None)
            for fd, dev in want.items():
                if have.get(fd) != dev:
                    table[R.NvFdKey(pid, fd)] = ctypes.c_uint32(dev)
            if want:
                self._fds[pid] = want
            else:
                self._fds.pop(pid, None)
        self.forget(*[pid for pid, since in self._gone.items() if now - since > self.keep_exited_s])

    def _sweep_exited(self, now: float) -> None:
        """A process that made CUDA calls or NVIDIA ioctls and exited before an fd scan saw it (they
        look at watched processes once per fd_scan_s) left histogram and ioctl-code entries that no
        scan would purge: they go keep_exited_s after this sweep finds them."""
        tgids = {k.tgid for name in (b"cu_hist", b"nv_cmd") for k in self.bpf[name].keys()}
        for tgid in tgids - self._gone.keys():
            if not os.path.exists(f"{self.proc}/{tgid}"):
                self._gone[tgid] = now
        self.forget(*[pid for pid, since in self._gone.items() if now - since > self.keep_exited_s])

    def forget(self, *tgids: int) -> None:
        """Drop processes' per-process CUDA maps (histograms, ioctl codes, fds), in one pass over each."""
        gone = set(tgids)
        if not gone:
            return
        for tgid in gone:
            self._gone.pop(tgid, None)
            self._fds.pop(tgid, None)
        for name in (b"nv_cmd", b"cu_hist", b"nv_fds"):
            t = self.bpf[name]
            for k in [k for k in t.keys() if k.tgid in gone]:
                t.pop(k, None)

    # ---- the governor ----

    def _control(self, now: float) -> None:
        """Estimate each process's launch rates per symbol; set the weights that keep it within budget."""
        if self.calibration is None:
            return
        hits = sum(self.bpf[b"stats"][ctypes.c_int(R.C["MCP_STAT_CU_LAUNCH_HITS"])])
        per = {k.value: {f: getattr(v, f) for f in LAUNCH_FIELDS} for k, v in self.bpf[b"proc_stats"].items()}
        prev, self._ctl_prev = self._ctl_prev, (now, hits, per)
        if prev is None or now <= prev[0]:
            return
        dt = now - prev[0]
        rates = {p: {f: (n[f] - prev[2].get(p, n)[f]) / dt for f in LAUNCH_FIELDS} for p, n in per.items()}
        # counts are scaled in the kernel: estimates of the true rates; the rest of the host's hits are
        # of processes not watched, taken as one process calling the busiest symbol
        rest = max(0.0, (hits - prev[1]) / dt - sum(sum(r.values()) for r in rates.values()))
        if rest > 0:
            top = max(LAUNCH_FIELDS, key=lambda f: max((r[f] for r in rates.values()), default=0.0))
            rates[0] = {f: (rest if f == top else 0.0) for f in LAUNCH_FIELDS}
        # half of the last estimate: a window holds few duty cycles, its count is noisy
        old = self.rates
        self.rates = {p: {f: (r[f] + old[p][f]) / 2 if p in old else r[f] for f in LAUNCH_FIELDS}
                      for p, r in rates.items()}
        self._set_weights(plan_weights(self._steering(), self.calibration.cost_ns, self._budget(), self.weights),
                          now)

    def _steering(self) -> dict[int, dict[str, float]]:
        """The rates that set the shared weights. Only GPU users steer: a process that calls
        cuLaunchKernel without a context (no /dev/nvidia* fd: cuInit opens nvidiactl) would otherwise
        duty-cycle, and so blind, every real GPU process. The unwatched rest (pid 0) steers only where
        GPU processes are not watched (process.watch = marked)."""
        steer = {p: r for p, r in self.rates.items() if (p in self._fds if p else not self.auto_watch)}
        self.unsteered = len(self.rates) - len(steer)
        return steer

    def _budget(self) -> float:
        """The budget for the probes' counted time: each attach traps for attach_s before it counts."""
        return self.budget / (1 + self.attach_s / self.slice_s)

    def set_budget(self, budget: float) -> None:
        """A new budget, applied now from the last rate estimate."""
        with self._lock:
            self.budget = budget
            cost = self.calibration.cost_ns if self.calibration else 0.0
            self._set_weights(plan_weights(self._steering(), cost, self._budget()), time.monotonic())

    def _set_weights(self, weights: dict[str, int], now: float) -> None:
        if weights == self.weights:
            return
        with self._duty_lock:
            for _, st in self._targets:
                self._account(st, now)  # credit earned so far at the old weight
            for f, w in weights.items():
                if w != self.weights[f]:
                    self._set_cfg(LAUNCH_CFG[f], w)
            self.weights = dict(weights)
        self._wake.set()
        self._update_rows()

    def _account(self, st: SymState, now: float) -> None:
        k = self.weights[st.sym.entry]
        st.credit += (now - st.last_t) * (1.0 / k - (1.0 if st.events else 0.0))
        st.credit = max(st.credit, -60.0)  # a debt from a long stall is paid back within a minute
        st.last_t = now

    def _duty(self, now: float) -> float:
        """Attach / detach launch probes in their turn; the time of the next turn."""
        nxt = now + 1.0
        for lib_, st in self._targets:
            with self._duty_lock:
                if self.paused or lib_.dropped or st.state != "attached":
                    continue
                nxt = min(nxt, self._turn(lib_, st))
        return nxt

    def _turn(self, lib_: Library, st: SymState) -> float:
        """One launch probe's turn: attach or detach it if due; when its next turn is."""
        nxt = time.monotonic() + 1.0
        k = self.weights[st.sym.entry] if self.governor else 1
        t = nxt - 1.0
        self._account(st, t)
        if k == 1:
            st.credit = 0.0
            if not st.events:
                self._attach_timed(lib_, st)
            return nxt
        if st.events:
            if st.credit <= 0:  # spent: off until a slice's worth is owed again
                self._detach(st)  # counting stops as the close begins (st.last_t)
                self.toggles += 1
                st.last_t = t
                nxt = min(nxt, t + (self.slice_s * (1 - 1 / k) - st.credit) * k)
            else:
                nxt = min(nxt, t + st.credit / (1 - 1 / k))
        else:
            owed = self.slice_s * (1 - 1 / k)
            if st.credit >= owed:
                if self._attach_timed(lib_, st):
                    self._account_off_until(st, st.on_since)
                    nxt = min(nxt, st.on_since + st.credit / (1 - 1 / k))
            else:
                nxt = min(nxt, t + (owed - st.credit) * k)
        return nxt

    def _account_off_until(self, st: SymState, t: float) -> None:
        """The attach call itself: off until its end (its events are set already)."""
        k = self.weights[st.sym.entry]
        st.credit += (t - st.last_t) / k
        st.last_t = t

    def _attach_timed(self, lib_: Library, st: SymState) -> bool:
        try:
            t0 = time.monotonic()
            self._attach(lib_, st)
            self.attach_s = 0.8 * self.attach_s + 0.2 * (st.on_since - t0)
            return True
        except Exception as e:
            # the path is our fd of the file (_pin): it cannot go with a process; no process mapping
            # the library any more means drop it
            alive = [p for p in lib_.pids if os.path.exists(f"{self.proc}/{p}")]
            if not alive:
                self._dead.add(lib_.key)  # the finder detaches the rest
            else:
                st.state, st.reason = "missing", f"attach uprobe {st.sym.name} in {lib_.shown}: {e}"
            return False

    def pause(self, paused: bool = True) -> None:
        """Detach the launch probes and stop toggling (benchmarks: the 'no agent' condition); pause(False)
        resumes with the weights and credits as they were."""
        with self._duty_lock:
            self.paused = paused
            now = time.monotonic()
            for _, st in self._targets:
                if paused:
                    self._detach(st)
                st.last_t = now
            if not paused:
                self._ctl_prev = None  # the next control window starts now
                self._duty(now)  # exact ones attached before this returns
            self._wake.set()

    # ---- reporting ----
    def governor_status(self) -> dict:
        """The governor for `mcp-agent probes` and metrics: budget, measured cost, duty cycle."""
        c = self.calibration
        cost = (c.cost_ns if c else 0.0) * 1e-9
        busiest = max(self.rates.items(), key=lambda kv: sum(kv[1].values()), default=(None, {}))[1]
        return {"budget": self.budget, "cost_ns": round(c.cost_ns, 1) if c else None,
                "calibrated_on": c.target if c else None, "weight": self.weight, "duty": 1.0 / self.weight,
                "weights": {f: w for f, w in self.weights.items() if w > 1},
                "launch_rate_hz": round(sum(busiest.values()), 1),
                "attached_overhead": round(sum(busiest.values()) * cost, 4),
                "overhead": round(sum(r * cost / w * (1 + self.attach_s / self.slice_s if w > 1 else 1)
                                      for f, r in busiest.items() for w in [self.weights[f]]), 4),
                "toggles": self.toggles, "unsteered": self.unsteered, "slice_s": self.slice_s, "attach_s": round(self.attach_s, 4),
                "governor": self.governor, "uprobes": self._up.mode}

    def symbol_rows(self) -> list[dict]:
        """One row per (libcuda file, symbol): state and reason. A snapshot from the last service pass."""
        return self._rows

    def _symbol_rows(self) -> list[dict]:
        return [{"library": lib_.shown, "file": f"{lib_.key[0]:x}:{lib_.key[1]:x} {lib_.key[2]}",
                 "pids": len(lib_.pids), "symbol": st.sym.name, "probe": st.sym.probe,
                 "state": st.state, "reason": st.reason,
                 "duty_cycled": st.sym.probe == DUTY_PROBE and self.weights[st.sym.entry] > 1}
                for lib_ in self.libs.values() for st in lib_.syms.values()] + [
                {"library": shown, "file": f"{k[0]:x}:{k[1]:x} {k[2]}", "pids": 0, "symbol": "*", "probe": "",
                 "state": "refused", "reason": why, "duty_cycled": False}
                for k, (shown, why) in list(self.refused.items())[-MAX_REFUSED_ROWS:]]

    def libraries(self) -> dict[tuple, Library]:
        with self._lock:
            return dict(self.libs)

    def ioctl_rows(self) -> list[dict]:
        """Per process, device file and request code: count and ns (metric mcp.nvidia.ioctl.*)."""
        names = {v: k for k, v in self._dev_ids.items()}
        return [{"pid": k.tgid, "device": names.get(k.dev, f"dev{k.dev}"), "cmd": f"0x{k.cmd:08x}",
                 "type": f"0x{(k.cmd >> 8) & 0xff:02x}", "nr": k.cmd & 0xff, "count": v.count, "ns": v.ns}
                for k, v in self.bpf[b"nv_cmd"].items()]

    def hist_rows(self) -> list[dict]:
        """Per process and kind (ctx, sync, ioctl, alloc, free): log2 buckets, le_ns = 2^(slot+1) - 1."""
        return [{"pid": k.tgid, "kind": R.HIST_KINDS.get(k.kind, str(k.kind)), "le_ns": (2 << k.slot) - 1,
                 "count": v.value} for k, v in self.bpf[b"cu_hist"].items()]


def probe_report(bpf, plan: ProbePlan, proc_root: str = "/proc") -> str:
    """For `mcp-agent probes`: every libcuda mapped now and its symbols, found, not attached (attaching
    and detaching ~40 uprobes would take seconds); the plan's CUDA rows are updated in place."""
    cp = CudaProbes(bpf, plan, governor=False, attach_uprobes=False, proc_root=proc_root)
    cp.start(thread=False)
    cp.rescan(full=True)
    cp.stop()
    rows = cp.symbol_rows()
    how = f"mechanism: {cp._up.mechanism}\n"
    return how + (render_symbols(rows) if rows else
                  "no process maps libcuda.so now: uprobes are attached as processes map it")


def render_symbols(rows: list[dict]) -> str:
    """`mcp-agent probes` detail: one line per (libcuda file, symbol)."""
    head = ("LIBRARY", "SYMBOL", "STATE", "DETAIL")
    lines = [head] + [(r["library"], r["symbol"], r["state"] + (" (duty-cycled)" if r["duty_cycled"] else ""),
                       r["reason"]) for r in rows]
    w = [max(len(x[i]) for x in lines) for i in range(3)]
    return "\n".join(f"{a:<{w[0]}}  {b:<{w[1]}}  {c:<{w[2]}}  {d}" for a, b, c, d in lines)


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
                      rounds: int = 7, name: str | None = None) -> Calibration:
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


def calibrate(bpf, target=None, n: int = 2000, rounds: int = 7, fn_name: str = "cu_launch") -> Calibration:
    """Per-hit cost of our launch program on this host: time n calls of a tiny function with it attached
    (this thread only; this process with uprobe_multi links, whose pid filter is per process) and without,
    interleaved; the median difference. The calling process is watched meanwhile, so the program takes its
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
    return Calibration(max(0.0, statistics.median(on) - statistics.median(off)), statistics.median(off),
                       f"{os.path.basename(path)}@0x{addr:x}", rounds)
