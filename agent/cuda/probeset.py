"""CUDA driver calls and NVIDIA ioctls: find every libcuda.so, attach per inode, keep within a budget.

Hooks (bpf/cuda.bpf.c): uprobes on libcuda.so exports; its own programs on syscalls:sys_enter_ioctl /
sys_exit_ioctl and sched:sched_process_exit (attached here by fd, not through bcc's attach_tracepoint,
whose table is keyed by tracepoint name and would lose the marker's fd); the process_exec hook of
sched:sched_process_exec (map cu_exec, drained here).

This module is the orchestrator, CudaProbes: its state, threads, service passes, attach and detach.
capability.py is the capability as the core sees it (the probes, GPU step spans, findings, metric
rows). The rules they apply live beside them, one job each:
  symbols.py    the driver API symbols probed (SYMBOLS, LAUNCH_FIELDS, ...) and a symbol's state
  finder.py     libcuda in /proc/PID/maps, resolving, checking and pinning the mapped file
  governor.py   launch rates, the weights (plan_weights) and each launch probe's duty cycle
  calibrate.py  the per-hit cost, timed on a memfd stand-in of the agent's own
  ioctl.py      the NVIDIA ioctl side: tracepoint layout, the fd-table scan's pieces, map rows
  steps.py      zero-touch GPU step records and per-request findings
  telemetry.py  GPU step span specs and the governor, ioctl and latency metric rows

Libraries. Uprobes bind to the inode, so they are attached once per (device, inode) and also fire in
every process that maps that inode later; a new inode is found by rereading the maps of processes that
exec (soon after the exec and again while they may still dlopen it) and of every process every
`rescan_s`. A library whose processes have all gone is detached. A symbol a library lacks is missing
for that library only, with its reason (symbol_rows(), the probe table).

NVIDIA fds. The kernel counts ioctls on fds listed in map nv_fds, which this module keeps from
/proc/PID/fd of watched processes every `fd_scan_s` (scan_fds; why fds, ioctl.py).

Overhead governor. When the first libcuda appears, its launch probe's per-hit cost is calibrated
(calibrate.py); every control window the rates are estimated and the weights set (governor.py), and
the duty cycler attaches and detaches the launch probes in their turns.

Uprobes are attached one per (symbol, entry|return) through agent/cuda/uprobes.py: BPF uprobe_multi
links on Linux 6.6+ (released within milliseconds), bcc's perf-event uprobes otherwise.

Threads: two of its own (start()): the finder (maps, fds, exec, control) and the duty cycler, apart
because the slices need timing that neither the agent's poll loop nor a finder pass that detaches a
library (one grace period per probe) can give; service() does both where a caller owns the loop.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from ..core import procscan
from ..core.probes import ATTACHED, DISABLED, DUTY_CYCLED, MISSING, WAITING, ProbePlan
from . import coverage
from . import governor as gov
from . import ioctl, libtrust, uprobes
from .calibrate import Calibration, calibrate, calibrate_standin
from .finder import (CAP_REASON, MAX_REFUSED_KEPT, RESCAN_BUDGET_S, RESCAN_PASS_S, START_ROUND_S, Library, Mapping,
                     close_library, libcuda_mappings, pin, resolve)
from .ioctl import TRACEFS, syscall_layout_ok
from .records import C
from .symbols import (DUTY_PROBE, LAUNCH_CFG, LAUNCH_FIELDS, SYMBOLS, UPROBE_ROWS, WAITING_DETAIL, SymState,
                      family_status)

MAX_REFUSED_ROWS = 32  # refused files in `mcp-agent probes` and symbol_rows(): the latest


class CudaProbes:
    """Attach, follow and govern the CUDA probes of one compiled unit (bcc BPF object).

        cp = CudaProbes(bpf, plan, budget=0.005, auto_watch=cfg.process_watch == "gpu")
        cp.start()            # attaches, calibrates, starts its thread
        cp.governor_status(); cp.symbol_rows(); cp.ioctl_rows(); cp.hist_rows()
        cp.stop()             # before bpf.cleanup()
    """

    def __init__(self, bpf, plan: ProbePlan, budget: float = 0.005, auto_watch: bool = True,
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
        self.refused_total = 0  # distinct files refused since start (hostagent.agent.records.rejected)
        self.enabled = {n for n in UPROBE_ROWS + ("nvidia_ioctl", "cuda_thread_exit", "process_exec")
                        if n in plan.statuses and plan.statuses[n].state not in (MISSING, DISABLED)}
        self.weights = {f: 1 for f in LAUNCH_FIELDS}
        self.paused = False
        self.calibration: Calibration | None = None
        self.costs: list[float] = []  # the last calibrations' per-hit costs, ns
        self._next_calibration = float("inf")
        self._starting = False
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
        self.on_log = coverage.OnLog()  # when each launch probe was on (request coverage)
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
        self._set_cfg(C["MCP_CFG_AUTO_WATCH"], int(self.auto_watch))
        self._set_cfg(C["MCP_CFG_MAX_CALL_NS"], int(self.max_call_s * 1e9))
        self.set_tracepoints(True)
        for name in UPROBE_ROWS:
            if name in self.enabled:
                self.plan.mark(name, WAITING, WAITING_DETAIL)  # armed as libraries are found (_update_rows)
        if self.governor and DUTY_PROBE in self.enabled and calibrate_target is not None:
            self.calibration = calibrate(self.bpf, target=calibrate_target)
        self._starting = True
        try:
            self.service()
        finally:
            self._starting = False
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
                close_library(lib_)

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
            # mostly attach/detach waits, so not in start-up: the governor weighs nothing before the first
            if ((self.calibration is None or now >= self._next_calibration) and self.libs and self.governor
                    and self.attach_uprobes and DUTY_PROBE in self.enabled and not self._starting
                    and not self.paused):
                self._calibrate(next(iter(self.libs.values())))
            if now >= self._next["rescan"]:
                if self.rescan(until=now + START_ROUND_S if self._starting else None):
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
        hs, t_call = [], time.monotonic()
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
        if st.sym.probe == DUTY_PROBE:
            self.on_log.on(id(st), t_call, st.on_since)

    def _detach(self, st: SymState) -> None:
        on = st.on_since is not None
        if on:
            off = time.monotonic()
            st.attached_s += off - st.on_since
            st.on_since = None
            self.on_log.closing(id(st), off)
        for h in st.events:
            self._up.detach(h)
        st.events = []
        if on:
            self.on_log.off(id(st), time.monotonic())  # hits may count until the release returns

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

    def rescan(self, full: bool = False, until: float | None = None) -> bool:
        """One pass of the walk over every process's maps (procscan.Walker: RESCAN_BUDGET_S of wall time,
        resumed at the next pass; full: passes until the round ends; until: passes until then, or the
        round's end): new libraries attached, and at the end of a round, libraries that no process
        mapped during it detached. True when a round ended."""
        while True:
            done = self._walker.walk(self._rescan_visit)
            if done or self._stop.is_set() or not (full or (until is not None and time.monotonic() < until)):
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
        for st in lib_.syms.values():
            self.on_log.forget(id(st))
        close_library(lib_)

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
            path = resolve(self.proc, pid, m)
        except libtrust.Untrusted as e:
            self._refuse(key, shown, f"not trusted: {e}")
            return None
        if path is None:
            return None
        if len(self.libs) >= self.max_libraries:
            self._refuse(key, shown, f"{CAP_REASON} ({self.max_libraries}) files followed already")
            return None
        try:
            fd = pin(path, key)
        except libtrust.Untrusted as e:
            self._refuse(key, shown, f"not trusted: {e}")
            return None
        except OSError:  # gone meanwhile: the next scan tries again
            return None
        lib_ = Library(key, f"/proc/self/fd/{fd}", shown, start=m.start, fd=fd)
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
        """Probe table rows (symbols.family_status): armed while a library has one of its symbols
        attached, waiting while none is followed, the misses named. Also the duty cycler's list of
        launch probes."""
        self._targets = [(lib_, st) for lib_ in self.libs.values() for st in lib_.syms.values()
                         if st.sym.probe == DUTY_PROBE and st.addr is not None and st.state != "alias"]
        self._wake.set()
        for row in UPROBE_ROWS:
            if row not in self.enabled:
                continue
            libs = [[st for st in lib_.syms.values() if st.sym.probe == row] for lib_ in list(self.libs.values())]
            state, detail = family_status(row, libs, self.attach_uprobes, self.weight if self.governor else 1,
                                          self.paused)
            if state == DUTY_CYCLED:
                detail += f" (budget {self.budget:.1%})"
            if self.refused_total:
                detail += f"; {self.refused_total} refused (not root's, or cuda.max_libraries)"
            self.plan.mark(row, state, detail,
                           "this driver lacks these symbols (symbol_rows() lists them)" if state == MISSING else "")

    def _calibrate(self, lib_: Library) -> None:
        """The per-hit cost on this host, measured on the agent's stand-in for a followed library's
        cuLaunchKernel (calibrate_standin); else on libc's labs() in this process; else a conservative
        default (the trap floor of docs/machines.md). Repeated every gov.RECALIBRATE_S; the governor
        weighs by the highest of the last few (gov.charged_cost)."""
        self._next_calibration = time.monotonic() + gov.RECALIBRATE_S
        for t in (lambda: calibrate_standin(self.bpf, lib_.path, name=os.path.basename(lib_.shown)),
                  lambda: calibrate(self.bpf)):
            try:
                c = t()
            except Exception as e:
                self.errors.append(f"calibrate: {type(e).__name__}: {e}")
                continue
            self.costs = (self.costs + [c.cost_ns])[-gov.CALIBRATIONS_KEPT:]
            self.calibration = replace(c, cost_ns=gov.charged_cost(self.costs))
            break
        else:
            if self.calibration is None:
                self.calibration = Calibration(12_000.0, 0.0, "default (calibration failed)", 0)
        # the calibration's own hits (rounds x calls, at the weight) are in the host-wide launch count:
        # the next control window starts after them, or they would read as an unwatched process's rate
        self._ctl_prev = None
        # so a new charged cost applies now, from the last rate estimate: the first complete window can
        # be 2 x 3 x weight x slice away, long enough for a risen cost to overrun the budget
        if self.rates and self.governor:
            self._set_weights(gov.plan_weights(self._steering(), self.calibration.cost_ns, self._budget(),
                                               self.weights), time.monotonic())

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
                want = ioctl.device_fds(self.proc, pid, self.device_globs, self._device_id)
                self._gone.pop(pid, None)
            except OSError:
                self._gone.setdefault(pid, now)
            ioctl.sync_fd_table(table, pid, self._fds.get(pid, {}), want)
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
        hits = sum(self.bpf[b"stats"][ctypes.c_int(C["MCP_STAT_CU_LAUNCH_HITS"])])
        per = {k.value: {f: getattr(v, f) for f in LAUNCH_FIELDS} for k, v in self.bpf[b"proc_stats"].items()}
        prev, self._ctl_prev = self._ctl_prev, (now, hits, per)
        if prev is None or now <= prev[0]:
            return
        self.rates = gov.window_rates(prev, now, hits, per, self.rates)
        self._set_weights(gov.plan_weights(self._steering(), self.calibration.cost_ns, self._budget(), self.weights),
                          now)

    def _steering(self) -> dict[int, dict[str, float]]:
        """The rates that set the shared weights: GPU users' (those with an NVIDIA fd, governor.steering)."""
        steer = gov.steering(self.rates, self._fds, self.auto_watch)
        self.unsteered = len(self.rates) - len(steer)
        return steer

    def _budget(self) -> float:
        """The budget for the probes' counted time: each attach traps for attach_s before it counts."""
        return gov.counted_budget(self.budget, self.attach_s, self.slice_s)

    def set_budget(self, budget: float) -> None:
        """A new budget, applied now from the last rate estimate."""
        with self._lock:
            self.budget = budget
            cost = self.calibration.cost_ns if self.calibration else 0.0
            self._set_weights(gov.plan_weights(self._steering(), cost, self._budget()), time.monotonic())

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
        gov.account(st, self.weights[st.sym.entry], now)

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
        """One launch probe's turn: attach or detach it if due; when its next turn is (governor.turn)."""
        now = time.monotonic()
        k = self.weights[st.sym.entry] if self.governor else 1
        return gov.turn(st, k, self.weights[st.sym.entry], self.slice_s, now,
                        attach=lambda: self._attach_timed(lib_, st), detach=lambda: self._toggle_off(st))

    def _toggle_off(self, st: SymState) -> None:
        """A duty-cycled probe's off turn."""
        self._detach(st)
        self.toggles += 1

    def _attach_timed(self, lib_: Library, st: SymState) -> bool:
        try:
            t0 = time.monotonic()
            self._attach(lib_, st)
            self.attach_s = 0.8 * self.attach_s + 0.2 * (st.on_since - t0)
            return True
        except Exception as e:
            # the path is our fd of the file (pin): it cannot go with a process; no process mapping
            # the library any more means drop it
            alive = [p for p in lib_.pids if os.path.exists(f"{self.proc}/{p}")]
            if not alive:
                self._dead.add(lib_.key)  # the finder detaches the rest
            else:
                st.state, st.reason = "missing", f"attach uprobe {st.sym.name} in {lib_.shown}: {e}"
            return False

    def launch_coverage(self, pid: int | None, t0_ns: int, t1_ns: int) -> dict[str, tuple[float, float]]:
        """Launch field -> (surely, maybe) share of [t0, t1] its probe was on in the libcuda that pid
        maps (the least, if it maps several; coverage.OnLog). Empty when pid maps none followed.
        pid None: the least over every libcuda followed (a serving group's processes)."""
        t0, t1, now = t0_ns / 1e9, t1_ns / 1e9, time.monotonic()
        if t1 <= t0:  # an instant: on or off at it
            t0, t1 = t0 - 1e-6, t0 + 1e-6
        out: dict[str, tuple[float, float]] = {}
        for lib_, st in list(self._targets):
            if pid is not None and pid not in lib_.pids:
                continue
            sure, maybe = self.on_log.covered(id(st), t0, t1, now)
            f, old = st.sym.entry, out.get(st.sym.entry, (1.0, 1.0))
            out[f] = (min(old[0], sure / (t1 - t0)), min(old[1], maybe / (t1 - t0)))
        return out

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
        with self._lock:
            self._update_rows()  # cuda_launch: paused, or armed again

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
        """Per process, device file and request code: count and ns (metric hostagent.nvidia.ioctl.*)."""
        return ioctl.ioctl_rows(self.bpf[b"nv_cmd"], self._dev_ids)

    def hist_rows(self) -> list[dict]:
        """Per process and kind (ctx, sync, ioctl, alloc, free): log2 buckets (ioctl.hist_rows)."""
        return ioctl.hist_rows(self.bpf[b"cu_hist"])
