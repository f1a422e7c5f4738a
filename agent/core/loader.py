"""Compile the BPF programs with bcc (LLVM at start-up) and attach their probes.

bcc is imported here and nowhere else outside the agent's map reads, after tracefs is mounted:
bcc picks its tracefs path at import time. LLVM's diagnostics on near-miss headers are many and
harmless; they are captured and shown only when compilation fails.
"""

from __future__ import annotations

import atexit
import base64
import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable

from . import bpfsys, compile_cache, compile_worker, mapset, own
from .probes import ATTACHED, MISSING, TRACEPOINT_KINDS, ProbePlan
from .records import bpf_source_dir


class LoadError(RuntimeError):
    pass


@dataclass
class Loaded:
    bpf: object  # bcc.BPF
    program: str
    compile_s: float
    processes: str = ""  # how it was compiled: "2 processes", or "1 process" and why


def _bpf_class():
    from bcc import BPF

    class ManualAttachBPF(BPF):
        adopted: dict[bytes, bytes] = {}
        made: dict[str, tuple[int, dict]] = {}  # table name -> (fd, description): a unit made without a compile

        def __init__(self, *args, **kwargs):
            self.refused: dict[bytes, str] = {}  # name -> the kernel's refusal at the check (_load_all)
            super().__init__(*args, **kwargs)

        @classmethod
        def from_maps(cls, desc: list) -> ManualAttachBPF:
            """A unit with no module: its maps made from the description (core/mapset.py), its programs
            all adopted. mapset.MapSetError if the maps cannot be made."""
            self = cls.__new__(cls)
            self.refused = {}
            # BPF.__init__'s state before its compile (bcc 0.26; tests/core/test_mapset.py holds a made
            # unit's attributes to a compiled one's): what attach, detach and cleanup read
            for a in ("kprobe_fds", "uprobe_fds", "tracepoint_fds", "raw_tracepoint_fds", "kfunc_entry_fds",
                      "kfunc_exit_fds", "lsm_fds", "perf_buffers", "open_perf_events", "funcs", "tables"):
                setattr(self, a, {})
            self._ringbuf_manager = self.tracefile = self.module = None
            self.debug = 0
            self.made = mapset.make(desc)
            atexit.register(self.cleanup)
            return self

        def table_fd(self, name: str) -> int:
            if self.module is None:
                return self.made[name][0] if name in self.made else -1
            from bcc import libbcc

            return libbcc.lib.bpf_table_fd(self.module, name.encode())

        def get_table(self, name, keytype=None, leaftype=None, reducer=None):
            key = name.decode() if isinstance(name, bytes) else name
            if self.module is not None or key not in self.made:
                return super().get_table(name, keytype, leaftype, reducer)
            fd, m = self.made[key]
            return mapset.table(self, m, fd, keytype, leaftype, reducer)

        def cleanup(self):
            try:
                super().cleanup()
            finally:  # after the ring buffers' manager is freed (it maps them)
                mapset.close(self.made)

        # bcc attaches every tracepoint__* function while constructing, and one failure raises for
        # all; we attach one by one so that each probe gets its own status.
        def _trace_autoload(self):
            pass

        def adopt(self, funcs: dict[bytes, bytes], license: bytes, kern_version: int) -> None:
            """Programs from compile workers or the compile cache, their map references already this
            object's; loaded on first use, as bcc loads its own."""
            self.adopted, self.adopted_license, self.adopted_kern_version = funcs, license, kern_version

        def load_func(self, func_name, prog_type, device=None, attach_type=-1):
            func_name = func_name if isinstance(func_name, bytes) else func_name.encode()
            if func_name in self.refused:  # checked once already: bcc would print its verifier log again
                raise Exception(self.refused[func_name])
            insns = self.adopted.get(func_name)
            if insns is None or func_name in self.funcs:
                return super().load_func(func_name, prog_type, device, attach_type)
            if device is not None:
                raise Exception(f"{func_name.decode()} was compiled by the worker: no offload")
            # bcc's own load adds the module's BTF line info, which the worker's programs lack here:
            # a verifier error then names instructions, not source lines (`probes --dump` has both).
            # Through the syscall, not bcc_prog_load: uprobe_multi programs need an expected attach type.
            fd, err = bpfsys.prog_load(prog_type, insns, self.adopted_license, self.adopted_kern_version, func_name,
                                       max(attach_type, 0))
            if fd < 0:
                raise Exception(f"Failed to load BPF program {func_name.decode()}: {bpfsys.why(err)}")
            fn = BPF.Function(self, func_name, fd)
            self.funcs[func_name] = fn
            return fn

    return ManualAttachBPF


# One compile unit, in this order: common.bpf.c holds the maps and helpers every family uses.
UNIT = ("common.bpf.c", "requests.bpf.c", "http.bpf.c", "reclaim.bpf.c", "cuda.bpf.c", "health.bpf.c")
UNIT_NAME = "agent.bpf"


def bpf_settings(cfg) -> dict[str, int]:
    """The BPF programs' compile-time settings (-D), each capability's and the watch mode."""
    from ..http import records as http_records  # not the capabilities: they import the pipeline
    from ..reclaim import records as reclaim_records
    from ..requests import records as requests_records

    return {"MCP_WATCH_ALL": cfg.process_watch == "all", **requests_records.bpf_settings(cfg),
            **reclaim_records.bpf_settings(cfg), **http_records.bpf_settings(cfg)}


def cflags_for(plan: ProbePlan, settings: dict[str, int]) -> list[str]:
    flags = [f"-I{bpf_source_dir()}"]
    flags += [f"-D{k}={int(v)}" for k, v in sorted(settings.items())]
    flags += [f"-D{spec.macro}=1" for spec in plan.enabled()]
    return flags


def unit_source() -> str:
    """The text bcc compiles: each source file present, in UNIT order, with a marker line each."""
    parts = []
    for name in UNIT:
        path = os.path.join(bpf_source_dir(), name)
        if os.path.exists(path):
            with open(path) as f:
                parts.append(f'#line 1 "{name}"\n' + f.read())
    return "\n".join(parts)


def _check_header_tree() -> None:
    """bcc's prelude includes ./include/linux/kconfig.h of the header tree (BCC_KERNEL_SOURCE, else
    /lib/modules/R/build when present; kheaders otherwise). Without it the compile stops at its first
    line, and libbcc 0.26's type visitor then walks the broken AST and can crash the process
    (SIGSEGV in BTypeVisitor::VisitVarDecl, seen with a tree holding only include/): refused here."""
    explicit = os.environ.get("BCC_KERNEL_SOURCE")
    modules = f"/lib/modules/{os.uname().release}"
    tree = explicit or f"{modules}/build"
    # Debian splits a tree: build -> linux-headers-R-<flavour> (generated), source -> -common (kconfig.h
    # among the rest); bcc reads both
    homes = [tree, os.path.join(tree, "source")] + ([] if explicit else [f"{modules}/source"])
    if os.path.isdir(tree) and not any(os.path.exists(os.path.join(h, "include", "linux", "kconfig.h")) for h in homes):
        raise LoadError(f"compile {UNIT_NAME}: Failed to compile: {tree} has no include/linux/kconfig.h "
                        "(not a kernel header tree)")


def _compile_quietly(text: str, cflags: list[str], progress: Callable[[str], None] | None):
    """Compile with fds 1 and 2 redirected (libbcc prints clang diagnostics on 2 and some errors,
    such as missing headers, on 1, where --console spans go), ticking progress on the real fd 2."""
    BPF = _bpf_class()
    saved, saved_out = os.dup(2), os.dup(1)
    done = threading.Event()
    t0 = time.monotonic()

    def tick():
        while not done.wait(0.25):
            if progress:
                progress(f"compiling {UNIT_NAME} with LLVM... {time.monotonic() - t0:.1f}s")

    with tempfile.TemporaryFile() as diag:
        sys.stderr.flush()
        sys.stdout.flush()
        os.dup2(diag.fileno(), 2)
        os.dup2(diag.fileno(), 1)
        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            bpf = BPF(text=text.encode(), cflags=cflags)
        except Exception as e:
            os.dup2(saved, 2)
            os.dup2(saved_out, 1)
            diag.seek(0)
            errors = [ln for ln in diag.read().decode(errors="replace").splitlines() if "error:" in ln]
            raise LoadError(f"compile {UNIT_NAME}: {e}: {'; '.join(errors[:3]) or 'no compiler error line'}") from e
        finally:
            done.set()
            os.dup2(saved, 2)
            os.dup2(saved_out, 1)
            os.close(saved)
            os.close(saved_out)
    return bpf, time.monotonic() - t0


# Parts of the unit compile in worker processes (compile_worker.py) while this one compiles the
# rest: LLVM is most of start-up and libbcc runs one compile per process. Each compile pays a fixed
# prelude (bcc's helpers and the kernel headers: 0.58 s of a 1.1 s part on this VM, docs/PERFORMANCE.md),
# so more parts shorten the slowest only down to that: groups by the number of workers the CPUs, their quota and
# the memory cgroup allow (split_for takes the largest that fits). A group names sources (their
# tracepoint probes) or probes (the uprobes included); a probe goes to the first group naming it.
# What no group takes is this process's part ("here"): on two CPUs requests.bpf.c and the uprobes,
# on four the uprobes, on six cuda_launch, cuda_graph and cuda_ctx. Six workers once took every uprobe,
# leaving the maps alone here: on the H100 host that compile ended 0.5 s before the slowest worker's,
# and the two slowest parts were the two with uprobes (2026-12-06); with all six here, this part was
# the slowest (0.86 s serially against 0.60-0.77) and the H100 host's first start waited for it alone.
# The six now spread so that every part costs 0.69-0.76 s serially here, this one among the lightest
# (the workers were then spawned just before this process's bcc import and had to start Python and
# import bcc themselves; `run` now begins them before its CLI import, begin_early).
# On the GPU host the gain was within the noise (docs/PERFORMANCE.md, 2026-12-07); kept for the
# serial balance. Every part is kept in the compile cache (compile_cache.py)
# with the maps' description: a start whose parts are all cached makes the maps from it (mapset.py)
# and compiles nothing. Measured: docs/PERFORMANCE.md.
_HTTP_IN = ("http_read", "http_read_ret", "http_recvfrom", "http_recvfrom_ret", "http_close")
WORKER_GROUPS = {
    1: (("http.bpf.c", "reclaim.bpf.c", "cuda.bpf.c", "health.bpf.c"),),
    2: (("requests.bpf.c", "reclaim.bpf.c"), ("http.bpf.c", "cuda.bpf.c", "health.bpf.c")),
    4: (("requests.bpf.c",), ("reclaim.bpf.c", "cuda.bpf.c", "health.bpf.c"), _HTTP_IN, ("http.bpf.c",)),
    6: (("marker",), ("reclaim.bpf.c", "sched_wakeup", "cuda_sync"), ("requests.bpf.c",), _HTTP_IN, ("http.bpf.c",),
        ("cuda.bpf.c", "health.bpf.c", "cuda_alloc", "cuda_free")),
}
SPLIT_ENV = "MCP_HOSTAGENT_COMPILE_SPLIT"  # "0": one compile process (bench_startup compares the two); "N": at most N workers
BPF_LD_IMM64, BPF_PSEUDO_MAP_FD = 0x18, 1  # include/uapi/linux/bpf.h
WORKER_TIMEOUT_S = 60.0  # after this process's own compile: far above any compile seen (~2.5 s)
# A program whose context is struct pt_regs is kprobe-type (bpf/cuda.bpf.c's uprobes); every other
# program of the unit is a tracepoint's (tests/core/test_loader_split.py holds the sources to it)
KPROBE_PROGRAM = re.compile(r"^int\s+(\w+)\s*\(\s*struct\s+pt_regs\s*\*", re.M)

# Memory a start charges to its cgroup after split_for decides (docs/PERFORMANCE.md): one process
# peaks at 145 MiB charged, 15 MiB of it already there at the decision; the first worker added 42
# MiB, the second 48-59. With 20 and 5-22 MiB of margin.
START_MEMORY = 150 << 20
WORKER_MEMORY = 64 << 20


@dataclass(frozen=True)
class Part:
    """A share of the unit compiled apart and kept in the compile cache: its probes' macros and their
    tracepoints (the cache key's). A worker process compiles it, or with here=True this process does
    (what no worker group takes: the uprobes among it), when the cache has no entry for it."""
    macros: tuple[str, ...]
    tracepoints: tuple[str, ...]
    here: bool = False


def kprobe_programs(text: str) -> set[str]:
    return set(KPROBE_PROGRAM.findall(text))


def _part(specs: list, here: bool = False) -> Part:
    """A part of these probes: their macros, and the tracepoints of those that are not uprobes."""
    return Part(tuple(s.macro for s in specs), tuple(s.tracepoint for s in specs if s.kind != "uprobe"), here=here)


def _whole(plan: ProbePlan, why: str) -> tuple[tuple[Part, ...], str]:
    """The unit as one part compiled here: no worker, but the compile cache still holds it, so a
    host that cannot spare workers still starts without a compile next time."""
    return (_part(plan.enabled(), here=True),), why


def _worker_budget() -> tuple[int | None, str]:
    """How many compile workers this host allows: (n >= 1, ""); (0, why) where the unit compiles here as
    one cached part; (None, why) where it compiles in one process without the compile cache."""
    want = os.environ.get(SPLIT_ENV, "").strip()
    if want and not (want.isascii() and want.isdigit()):
        return 0, f"1 process ({SPLIT_ENV}={want[:20]!r} is not a number of workers)"
    if want and not int(want):
        return None, f"1 process ({SPLIT_ENV}=0)"
    if sys.byteorder != "little":  # _rebind_maps reads the instructions' immediates as little-endian
        return None, "1 process (big-endian host)"
    cpus = len(os.sched_getaffinity(0))
    quota = cpu_quota()
    if quota is not None and int(quota) < cpus:
        # workers share the quota with this process and each pays the compile's prelude again: under
        # a quota of one CPU the split took 2.98 s against 2.17 in one process (docs/PERFORMANCE.md)
        cpus = int(quota)
        if cpus < 2:
            return 0, f"1 process (a CPU quota of {quota:.2g} CPUs)"
    if cpus < 2:
        return 0, "1 process (one CPU)"
    workers = min(cpus - 1, max(WORKER_GROUPS), int(want) if want else max(WORKER_GROUPS))
    if not want and limits_hidden():
        return 0, (f"1 process (its cgroup's CPU and memory limits are hidden from it; {SPLIT_ENV}=N "
                   "allows N workers)")
    left = memcg_headroom()
    if left is not None:
        workers = min(workers, max(0, (left - START_MEMORY) // WORKER_MEMORY))
        if not workers:
            need = (START_MEMORY + WORKER_MEMORY) >> 20
            return 0, f"1 process (its memory cgroup has under {need} MiB below its limit)"
    return max(n for n in WORKER_GROUPS if n <= workers), ""


def split_for(plan: ProbePlan, budget: tuple[int | None, str] | None = None) -> tuple[tuple[Part, ...], str]:
    """(the parts, ""); (one part here, why no worker); or ((), why the unit compiles in one process
    without the compile cache: asked for, or a host whose instructions cannot be moved). budget:
    _worker_budget's answer taken earlier (begin_early's, before its workers were charged)."""
    workers, why = budget or _worker_budget()
    if workers is None:
        return (), why
    if not workers:
        return _whole(plan, why)
    groups = WORKER_GROUPS[workers]
    taken: dict[int, list] = {}
    for s in plan.enabled():
        i = next((i for i, g in enumerate(groups) if s.name in g or (s.kind != "uprobe" and s.program in g)), None)
        if i is not None:
            taken.setdefault(i, []).append(s)
    parts = [_part(taken[i]) for i in sorted(taken)]
    if not parts:
        return (), "1 process"
    # What no worker takes is this process's part. Cached too, so a cached start compiles nothing.
    side = {m for p in parts for m in p.macros}
    rest = [s for s in plan.enabled() if s.macro not in side]
    return tuple(parts) + ((_part(rest, here=True),) if rest else ()), ""


def _read_words(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().split()
    except OSError:
        return []


def _read_limit(path: str) -> int | None:
    w = _read_words(path)
    return int(w[0]) if len(w) == 1 and w[0].isdigit() else None  # "max": none


def _hierarchies(controller: str, proc_cgroup: str, root: str) -> list[tuple[str, str, bool]]:
    """(mount point, this process's path in it, v2?) of the hierarchies that may hold controller's
    files for this process: the unified one (v2, or hybrid's /sys/fs/cgroup/unified) and a v1 one
    whose /proc/self/cgroup line names the controller."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            base = root if os.path.isfile(os.path.join(root, "cgroup.controllers")) else os.path.join(root, "unified")
            found.append((base, path, True))
        elif controller in controllers.split(","):
            # systemd links cpu -> cpu,cpuacct; without it the mount is named by the line's controllers
            base = os.path.join(root, controller)
            found.append((base if os.path.isdir(base) else os.path.join(root, controllers), path, False))
    return found


def _up(base: str, path: str):
    """This process's cgroup directory in a hierarchy, then each parent up to its root."""
    parts = [p for p in path.split("/") if p and p != ".."]
    for i in range(len(parts), -1, -1):
        yield os.path.join(base, *parts[:i])


def memcg_headroom(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's memory cgroup may still charge before the lowest limit on its way to the
    root (v2 memory.high and memory.max against memory.current, v1 memory.limit_in_bytes against
    memory.usage_in_bytes: a systemd unit's MemoryHigh/MemoryMax, a slice's, a container's); None
    where nothing is limited or readable."""
    best = None
    for base, path, v2 in _hierarchies("memory", proc_cgroup, root):
        limits, usage = (("memory.high", "memory.max"), "memory.current") if v2 else \
            (("memory.limit_in_bytes",), "memory.usage_in_bytes")
        for d in _up(base, path):
            lims = [v for v in (_read_limit(os.path.join(d, f)) for f in limits) if v is not None]
            used = _read_limit(os.path.join(d, usage))
            if lims and used is not None:
                left = max(0, min(lims) - used)
                best = left if best is None else min(best, left)
    return best


def cpu_quota(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs' worth of run time per period the lowest CFS quota on the way to the root allows (v2
    cpu.max "quota period", "max" for none; v1 cpu.cfs_quota_us / cpu.cfs_period_us, -1 for none):
    a container's CPU limit, a unit's CPUQuota. None where nothing is limited or readable."""
    best = None
    for base, path, v2 in _hierarchies("cpu", proc_cgroup, root):
        for d in _up(base, path):
            if v2:
                w = _read_words(os.path.join(d, "cpu.max"))
            else:
                w = _read_words(os.path.join(d, "cpu.cfs_quota_us")) + _read_words(os.path.join(d, "cpu.cfs_period_us"))
            if len(w) == 2 and w[0].isdigit() and w[1].isdigit() and int(w[1]):
                q = int(w[0]) / int(w[1])
                best = q if best is None else min(best, q)
    return best


def limits_hidden(mountinfo: str = "/proc/self/mountinfo", root: str = "/sys/fs/cgroup") -> bool:
    """True where a cgroup hierarchy this reads (v2, or v1's memory or cpu) is mounted under root
    with its root above this process's cgroup namespace: a container in its own namespace that
    mounts the node's /sys/fs/cgroup over its own (the DaemonSet does, for the marking processes'
    cgroups). /proc/self/cgroup's paths are relative to the namespace ("/" at its root), so they
    name the wrong directories there and the container's limits cannot be read. The kernel shows
    such a mount's root relative to the reader's namespace, as "/.." or "/../..." (mountinfo's
    fourth field; cgroup_show_path)."""
    try:
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    for line in lines:
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        mroot, point, fstype, opts = fields[3], fields[4], fields[sep + 1], fields[-1].split(",")
        ours = fstype == "cgroup2" or (fstype == "cgroup" and ("memory" in opts or "cpu" in opts))
        if ours and (point == root or point.startswith(root + "/")) and (mroot == "/.." or mroot.startswith("/../")):
            return True
    return False


def _rebind_maps(name: str, insns: bytearray, worker_maps: dict[str, str], fd_of: Callable[[str], int]) -> None:
    """Rewrite each map reference (ld_imm64 with BPF_PSEUDO_MAP_FD: the worker's fd) to this
    process's map of the same name. Any other pseudo load would name an object we cannot move."""
    i = 0
    while i + 8 <= len(insns):
        if insns[i] == BPF_LD_IMM64:
            src = insns[i + 1] >> 4
            if src == BPF_PSEUDO_MAP_FD:
                theirs = int.from_bytes(insns[i + 4:i + 8], "little", signed=True)
                table = worker_maps.get(str(theirs))
                mine = fd_of(table) if table else -1
                if mine < 0:
                    raise ValueError(f"{name}: map fd {theirs} ({table or 'not a table'}) has no map here")
                insns[i + 4:i + 8] = mine.to_bytes(4, "little", signed=True)
            elif src:
                raise ValueError(f"{name}: ld_imm64 with src_reg {src} cannot be moved between processes")
            i += 16
        else:
            i += 8


@dataclass
class _Job:
    """One part on its way: the cache's key and entry, or the worker compiling it."""
    part: Part
    flags: list[str]
    key: str | None = None
    reply: dict | None = None
    worker: _Worker | None = None
    cached: bool = False


@dataclass
class _Begun:
    """A compile's first step (_begin): the compile cache looked up, the workers sent their parts;
    or why it compiles in one process (fallback)."""
    t0: float
    jobs: list[_Job]
    cache: str | None = None
    note: str = ""
    maps_key: str | None = None
    desc: dict | None = None
    fallback: str = ""
    why: str = ""  # split_for's reason where its one part is compiled here
    hint: str = ""  # compile_cache.hint; warm: the last start stored it (so no worker was started ahead)
    warm: bool = False

    @property
    def workers(self) -> list[_Worker]:
        return [j.worker for j in self.jobs if j.worker]


def _begin(text: str, cflags: list[str], split: tuple[tuple[Part, ...], str], spawned: list[_Worker] | None = None,
           warm: tuple[str, bool] | None = None) -> _Begun:
    """Look each part up in the compile cache and send the others to workers (spawned: started ahead,
    waiting for a request). compile_ahead runs this before the pipeline's import begins: run in the
    compile thread, each file read gave the GIL to the import and waited up to a switch interval
    (5 ms) for it back, ~0.1 s on the H100 host before the workers had their parts.
    warm: (the start's compile_cache.hint, whether the cache holds it), if the caller looked."""
    spare = list(spawned or ())
    b = _Begun(time.monotonic(), [])
    try:
        b.hint, b.warm = warm or _warm(text, cflags, split)
        return _look_up_and_send(b, text, cflags, split, spare)
    except BaseException:  # ^C, or what the handlers below miss: no worker outlives the start
        _stop_all(spare + b.workers)
        raise


def _look_up_and_send(b: _Begun, text: str, cflags: list[str], split: tuple[tuple[Part, ...], str],
                      spare: list[_Worker]) -> _Begun:
    parts, why = split
    if not parts:
        _stop_all(spare)
        b.fallback = why
        return b
    b.why = why
    b.cache = compile_cache.directory()
    for p in parts:
        mine = {f"-D{m}=1" for m in p.macros}
        j = _Job(p, [f for f in cflags if f in mine or not f.startswith("-DMCP_PROBE_")])
        if b.cache:
            try:
                j.key = compile_cache.key(text, j.flags, list(p.tracepoints))
                j.reply = compile_cache.get(b.cache, j.key)
                j.cached = j.reply is not None
            except (compile_cache.CacheError, OSError, ValueError) as e:
                j.key, b.cache, b.note = None, None, f"; compile cache not used: {e}"
        b.jobs.append(j)
    try:
        for j in b.jobs:
            if not j.cached and not j.part.here:
                j.worker = spare.pop(0) if spare else _Worker()
                j.worker.send(text, j.flags)
    except (OSError, RuntimeError) as e:  # RuntimeError: no thread for its feed (TasksMax)
        _stop_all(spare + b.workers)
        b.jobs, b.fallback = [], f"1 process (worker: {e})"
        return b
    _stop_all(spare)  # started ahead for a part the cache holds
    if b.cache:  # the maps' description, made into maps if every part is cached (core/mapset.py)
        try:
            b.maps_key = compile_cache.key(text, [f for f in cflags if not f.startswith("-DMCP_PROBE_")], [],
                                           {"maps": [mapset.FORMAT, mapset.possible_cpus()]})
            b.desc = compile_cache.get(b.cache, b.maps_key)
        except (compile_cache.CacheError, OSError, ValueError) as e:
            b.maps_key, b.cache, b.note = None, None, f"; compile cache not used: {e}"
    return b


def _warm(text: str, cflags: list[str], split: tuple[tuple[Part, ...], str]) -> tuple[str, bool]:
    """(the hint, whether the last start left every part and the maps in the compile cache)."""
    h = compile_cache.hint(text, cflags, [p.macros for p in split[0]])
    cache = compile_cache.directory()
    return h, bool(cache and split[0]) and compile_cache.warm(cache, h)


def _compile(text: str, cflags: list[str], b: _Begun, progress: Callable[[str], None] | None):
    """(bpf, seconds, how): the unit compiled here, with each part (split_for) taken from the compile
    cache, or compiled in parallel by a compile_worker.py or here, and adopted; anything wrong with a
    part compiles it all here. b: _begin's look-ups and the workers it sent parts to."""
    if b.fallback:
        return (*_compile_quietly(text, cflags, progress), b.fallback)
    t0, jobs, cache, note, maps_key, desc = b.t0, b.jobs, b.cache, b.note, b.maps_key, b.desc
    workers = b.workers
    given = {f"-D{m}=1" for j in jobs if j.cached or j.worker for m in j.part.macros}
    bpf = None
    if desc is not None and all(j.cached for j in jobs):
        try:
            bpf = _bpf_class().from_maps(desc.get("maps"))
        except (mapset.MapSetError, OSError, ValueError) as e:
            compile_cache.drop(cache, maps_key)
            desc, note = None, note + f"; maps compiled ({e})"
    made = bpf is not None
    if not made:
        try:
            bpf, _ = _compile_quietly(text, [f for f in cflags if f not in given], progress)
        except BaseException:
            _stop_all(workers)
            raise
    kprobes = kprobe_programs(text)
    refused, writable, complete = None, True, True  # complete: every part and the maps now in the cache
    try:
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        adopted, checks = {}, []
        for j in jobs:
            if j.worker:
                j.reply = j.worker.reply(deadline)
            elif not j.cached:  # compiled here just now (what no cached or worker part gave): for the cache
                j.reply = compile_worker.reply_of(bpf.module)
            funcs = _rebound(bpf, j.reply)
            # a program no probe macro guards is in every part (a test's -D adds one): checked once
            mine = {n: i for n, i in funcs.items() if not _compiled_here(bpf, n) and n not in adopted}
            adopted.update(mine)
            checks.append(funcs if not (j.cached or j.worker) else mine)
        first = jobs[0].reply
        bpf.adopt(adopted, first["license"].encode(), int(first["kern_version"]))
        # Loaded now (attach would, a moment later): a cached program the kernel no longer takes
        # must not be kept, nor leave its probe missing at every start; a fresh part whose program
        # fails is not cached (its probe reports the verifier's error at attach, as in one process)
        for j, failed in zip(jobs, _load_parts(bpf, [(f, j.reply) for j, f in zip(jobs, checks)], kprobes)):
            if failed and j.cached:
                refused = j
                raise ValueError(f"{failed} from the compile cache")
            if not j.cached and cache and writable and j.key and not failed:
                try:
                    compile_cache.put(cache, j.key, j.reply)
                except compile_cache.CacheError as e:
                    writable, note = False, f"; compile cache not written: {e}"
            complete = complete and (j.cached or (writable and bool(j.key) and not failed))
        if not made and maps_key and writable and desc is None:
            try:  # the maps' description, for the next start whose parts are all cached
                compile_cache.put(cache, maps_key, {"maps": mapset.describe(bpf.module)})
            except (compile_cache.CacheError, mapset.MapSetError, OSError) as e:
                complete, note = False, note + f"; maps not described for the compile cache: {e}"
        early = compile_cache.early_hint(text)
        if cache and writable and complete and maps_key and not (b.warm and compile_cache.warm(cache, early, "early")):
            try:  # the next start (same unit, split and kernel) starts no worker ahead
                compile_cache.mark_warm(cache, b.hint, early)
            except compile_cache.CacheError:
                pass  # a hint: the next start only starts its workers ahead as before
        elif cache and b.warm and not complete:  # a part the cache will not hold (yet): workers ahead again
            compile_cache.drop(cache, compile_cache.WARM)
    except (ValueError, KeyError, TypeError, AttributeError, subprocess.TimeoutExpired) as e:
        _stop_all(workers)
        # the cached part the kernel refused; else any cached part may be the one that no longer fits
        for j in [refused] if refused else jobs:
            if j.cached and cache:
                compile_cache.drop(cache, j.key)
        if made:
            compile_cache.drop(cache, maps_key)
        if cache:
            compile_cache.drop(cache, compile_cache.WARM)
        bpf.cleanup()
        bpf, _ = _compile_quietly(text, cflags, progress)
        return bpf, time.monotonic() - t0, f"1 process (a part from a worker or the cache: {e})"
    except BaseException:
        _stop_all(workers)
        bpf.cleanup()
        raise
    n, cached = 1 + len(workers), sum(j.cached for j in jobs)
    how = b.why if n == 1 and b.why else f"{n} process{'es' if n > 1 else ''}"
    if cached:
        how += f", {cached} part{'s' if cached > 1 else ''}{' and the maps' if made else ''} from the compile cache"
    return bpf, time.monotonic() - t0, how + note


def _load_all(bpf, funcs: dict[bytes, bytes], kprobes: set[str], reply: dict) -> str:
    """Load each program: a tracepoint's is kept (attach uses it); a kprobe-type one (a uprobe) is
    loaded and closed again, since its attach mechanism (cuda/uprobes.py) picks how it is loaded.
    The first that fails and why, or ""."""
    for name, insns in funcs.items():
        if name.decode() in kprobes:
            fd, err = bpfsys.prog_load(bpfsys.BPF_PROG_TYPE_KPROBE, insns, reply["license"].encode(),
                                       int(reply["kern_version"]), name)
            if fd < 0:
                return f"{name.decode()}: {bpfsys.why(err)}"
            os.close(fd)
            continue
        try:
            bpf.load_func(name, type(bpf).TRACEPOINT)
        except Exception as e:  # noqa: BLE001 - bcc raises bare Exception with the kernel's reason
            bpf.refused[name] = str(e)  # the attach reports this, without a second load
            return f"{name.decode()}: {e}"
    return ""


def _load_parts(bpf, parts: list[tuple[dict[bytes, bytes], dict]], kprobes: set[str]) -> list[str]:
    """_load_all of each (funcs, reply), each part in a thread of its own: the verifier runs inside
    bpf(2), which ctypes calls without the GIL, so the parts are verified side by side (the H100
    host: 0.27 s one after another). What a thread raised is raised here, once all are done."""
    out: list = [""] * len(parts)

    def run(i):
        try:
            out[i] = _load_all(bpf, parts[i][0], kprobes, parts[i][1])
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
            out[i] = e

    threads = []
    for i in range(1, len(parts)):
        t = threading.Thread(target=run, args=(i,), name=f"mcp-bpf-load-{i}", daemon=True)
        try:
            t.start()
        except RuntimeError:  # no thread (TasksMax): this one loads it after the others
            t = None
        threads.append(t)
    try:
        if parts:
            run(0)
        for i, t in enumerate(threads, 1):
            if t is None:
                run(i)
    finally:  # ^C included: the caller frees the BPF object these threads load from
        for t in threads:
            if t is not None:
                t.join()
    for x in out:
        if isinstance(x, BaseException):
            raise x
    return out


def _stop_all(workers) -> None:
    for w in workers:
        w.stop()


class _Worker:
    """A compile_worker.py process, started at once (it imports bcc), compiling once sent a part."""

    def __init__(self):
        # its diagnostics go to a file, not a pipe: a compile that warns more than a pipe holds
        # (mismatched kernel headers do) would block it until this process's compile is done
        self.diag = tempfile.TemporaryFile()
        self.feed: threading.Thread | None = None
        try:
            # `-m` puts the working directory first on sys.path: run from / (root's) so that a module
            # planted where the agent was started cannot run as root; PYTHONPATH (bcc, on some hosts)
            # is kept. Its own session, and it ignores the stop signals (compile_worker.py): a ^C or
            # systemd's SIGTERM to the unit's cgroup stops the agent, which stops it or takes its reply.
            self.proc = subprocess.Popen([sys.executable, "-m", f"{__package__}.compile_worker"], cwd="/",
                                         env=dict(os.environ, PYTHONSAFEPATH="1"), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self.diag, start_new_session=True)
        except OSError:
            self.diag.close()
            raise
        own.started(self.proc)  # never watched (core/discovery.py)

    def send(self, text: str, flags: list[str]) -> None:
        """Write the request from a thread of its own (_feed), which closes stdin after it."""
        stdin, self.proc.stdin = self.proc.stdin, None  # communicate() must not flush it
        # begin_early starts it before kernel.prepare sets BCC_KERNEL_SOURCE: the request carries it
        req = {"text": text, "cflags": flags, "kernel_source": os.environ.get("BCC_KERNEL_SOURCE")}
        self.feed = threading.Thread(target=_feed, args=(stdin, json.dumps(req).encode()),
                                     name="bpf-compile-feed", daemon=True)
        try:
            self.feed.start()
        except RuntimeError:
            self.feed = None
            stdin.close()
            raise

    def reply(self, deadline: float) -> dict:
        if self.feed is not None:
            self.feed.join(max(0.0, deadline - time.monotonic()))
        out, _ = self.proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
        try:
            if self.proc.returncode != 0:
                self.diag.seek(0)
                lines = [ln for ln in self.diag.read().decode(errors="replace").splitlines() if "error" in ln]
                raise ValueError(f"exit {self.proc.returncode}: {'; '.join(lines[:2]) or 'no error line'}")
        finally:
            self.diag.close()
        return json.loads(out)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):  # stdin: never sent a part
            if f is not None:
                f.close()
        self.diag.close()
        if self.feed is not None and self.feed.is_alive():
            self.feed.join()  # the write ends with EPIPE once the worker is gone


def _compiled_here(bpf, name: bytes) -> bool:
    """bpf's own compile has the function (one no probe macro guards, such as a test's -D adds)."""
    if bpf.module is None:  # made from the cache: every program is a part's
        return False
    from bcc import libbcc

    return bool(libbcc.lib.bpf_function_start(bpf.module, name))


def _rebound(bpf, reply: dict) -> dict[bytes, bytes]:
    """A part's programs, their map references rewritten to bpf's maps."""
    funcs = {}
    for name, b64 in reply["funcs"].items():
        insns = bytearray(base64.b64decode(b64))
        _rebind_maps(name, insns, reply["maps"], bpf.table_fd)
        funcs[name.encode()] = bytes(insns)
    return funcs


def _feed(stdin, data: bytes) -> None:
    try:
        stdin.write(data)
    except OSError:  # it died: its exit status says why
        pass
    finally:
        try:
            stdin.close()
        except OSError:
            pass


MADV_PAGEOUT = 21  # Linux >= 5.4; older kernels answer EINVAL and keep the pages
_COMPILER_LIBS = ("libLLVM", "libclang")


def release_compiler_memory(maps_path: str = "/proc/self/maps") -> None:
    """Give back what the compile left resident and the agent will not use again: clang's freed heap
    (malloc_trim; ~20 MB) and the LLVM and clang code pages the compile touched (~80 MB of libLLVM and
    libclang-cpp, MADV_PAGEOUT). Measured with bench/bench_startup.py and bench_footprint.py: RSS
    ~163 -> ~70 MB. PAGEOUT only drops pages no other process maps and never loses data (file pages are
    read back, anonymous ones stay or go to swap), so a later compile (SIGHUP reload) faults them in."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        return
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    try:
        with open(maps_path) as f:
            lines = f.read().splitlines()
    except OSError:
        return
    for line in lines:
        x = line.split()
        if len(x) < 6 or "w" in x[1] or not os.path.basename(x[5]).startswith(_COMPILER_LIBS):
            continue
        lo, hi = (int(v, 16) for v in x[0].split("-"))
        madvise(lo, hi - lo, MADV_PAGEOUT)


class _Ahead:
    """A compile begun before it is needed (compile_ahead), taken by the load() it was begun for."""

    def __init__(self, key: tuple, progress, begun: _Begun):
        self.key, self.result, self.error, self.begun = key, None, None, begun
        self.thread = threading.Thread(target=self._run, args=(progress,), name="bpf-compile", daemon=True)

    def _run(self, progress) -> None:
        try:
            self.result = _compile(self.key[0], list(self.key[1]), self.begun, progress)
        except LoadError as e:
            self.error = e
        except Exception:  # noqa: BLE001 - bcc not importable, say: load() compiles again and reports it
            _stop_all(self.begun.workers)


_ahead: _Ahead | None = None


def compile_ahead(plan: ProbePlan, settings: dict[str, int], progress: Callable[[str], None] | None = None) -> None:
    """Begin compiling the unit in a thread; load() with the same plan and settings takes the result.
    `run` calls this before importing the pipeline (the OTel SDK and exporters: 0.5-0.7 s of start-up
    on the H200), so the two overlap: libbcc runs LLVM with the GIL released (a ctypes call).
    libbcc 0.26 cannot compile two units at once (a SIGSEGV, seen): load() waits for this one."""
    global _ahead
    early, budget = _take_early()  # begin_early's workers, sent parts below or stopped, and its count
    if _ahead is not None or not plan.enabled():
        _stop_all(early)
        return
    try:
        _check_header_tree()
    except LoadError:
        _stop_all(early)
        return  # load() reports it
    # the count begin_early made: counted again now, the room below a memory limit would be short by
    # what its workers and libbcc's load have charged since (~50 MiB a worker), and the split smaller
    split = split_for(plan, budget)
    key = (unit_source(), tuple(cflags_for(plan, settings)))
    warm = _warm(key[0], list(key[1]), split)
    if warm[1]:  # the cache most likely holds every part: workers would be started and stopped for nothing
        _stop_all(early)
        early = []
    spawned: list[_Worker] = early
    try:  # the workers first: each imports bcc while this process does (~0.1-0.2 s on the GPU hosts);
        # _begin starts one for a part it then does not find, and stops those it has no part for
        for _ in range(0 if warm[1] else sum(not p.here for p in split[0]) - len(early)):
            spawned.append(_Worker())
    except OSError:
        _stop_all(spawned)
        spawned = []  # _begin tries again, and compiles in one process if that fails too
    try:
        # bcc imported here, before the thread: imported in it, it would share the GIL with the
        # pipeline's import that runs meanwhile, and the compile (which holds no GIL) would begin late
        _bpf_class()
    except Exception:  # noqa: BLE001 - load() imports it again and reports what fails
        _stop_all(spawned)
        return
    try:
        job = _Ahead(key, progress, _begin(key[0], list(key[1]), split, spawned, warm))
    except Exception:  # noqa: BLE001 - its workers stopped (_begin): load() compiles and reports what fails
        return
    try:
        job.thread.start()
    except RuntimeError:  # no thread (TasksMax): load() compiles
        _stop_all(job.begun.workers)
        return
    _ahead = job


def compile_ahead_for(cfg, progress: Callable[[str], None] | None = None) -> None:
    """`run`: the compile Agent.start will load, begun now (tracefs and headers as Agent.start finds
    them; it repeats both and reports what fails)."""
    from . import kernel, probes

    try:
        kernel.prepare(cfg.kernel_headers, cfg.kernel_link_modules_build, report=False)  # Agent.start logs
    except kernel.KernelSetupError:
        _stop_early()
        return
    compile_ahead(probes.plan(cfg.probes_disable, off=probes.switched_off(cfg)), bpf_settings(cfg), progress)


_early: list[_Worker] = []
_early_budget: tuple[int | None, str] | None = None


def begin_early() -> None:
    """`run` as root, before the CLI's import (click and the config: 0.13-0.19 s on the quiet H100 host):
    libbcc's dlopen in a thread (ctypes drops the GIL for it; most of `import bcc` there), and the
    compile workers split_for will want, unless the last start of this unit on this kernel found every
    part in the compile cache. A worker needs 0.2-0.27 s there to start Python and import bcc: begun
    in compile_ahead, after the CLI's import and the config, it could compile only that long after
    this process sent its part. compile_ahead takes them; one never sent a part ends with this
    process (its stdin closes), or at its exit."""
    global _early_budget
    if os.geteuid() != 0 or _early_budget is not None:
        return
    _early_budget = _worker_budget()
    workers = _early_budget[0]
    cache = compile_cache.directory()
    if workers and not (cache and compile_cache.warm(cache, compile_cache.early_hint(unit_source()), "early")):
        atexit.register(_stop_early)  # a config or usage error exits before compile_ahead takes them
        try:
            for _ in range(workers):
                _early.append(_Worker())
        except OSError:  # compile_ahead tries again
            _stop_all(_early)
            _early.clear()
    try:  # after the workers: a fork waits for a dlopen in progress (glibc holds its loader lock)
        threading.Thread(target=_preload_libbcc, name="bcc-preload", daemon=True).start()
    except RuntimeError:  # no thread (TasksMax): bcc's import loads it
        pass


def _preload_libbcc() -> None:
    """dlopen(3) through a ctypes call, which drops the GIL for it: CPython 3.11's ctypes.CDLL holds
    the GIL while the loader maps and relocates libbcc and LLVM (seen: 30 ms of this VM's main thread)."""
    try:
        dlopen = ctypes.CDLL(None).dlopen  # glibc >= 2.34: in libc itself
        dlopen.restype, dlopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_int]
        # the soname and mode bcc/libbcc.py's CDLL asks for: its import then finds it loaded
        dlopen(b"libbcc.so.0", os.RTLD_NOW | os.RTLD_LOCAL)
    except (AttributeError, OSError):
        pass  # bcc's import loads it (and reports what fails)


def _take_early() -> tuple[list[_Worker], tuple[int | None, str] | None]:
    """begin_early's workers and worker budget, once."""
    global _early_budget
    got, budget = _early[:], _early_budget
    _early.clear()
    _early_budget = None
    return got, budget


def _stop_early() -> None:
    _stop_all(_take_early()[0])


def _take_ahead(key: tuple):
    """The compile begun ahead for key (bpf, seconds, how), raising its LoadError; None if there is none
    (one begun for another key is waited for and freed)."""
    global _ahead
    job, _ahead = _ahead, None
    if job is None:
        return None
    job.thread.join()
    if job.key != key:
        if job.result:
            job.result[0].cleanup()
        return None
    if job.error:
        raise job.error
    return job.result


def _fill_tails(bpf, plan: ProbePlan) -> None:
    """Each tail-called program (probes.TAILS) loaded into its prog array slot, before the probes
    that call it attach; one that fails leaves those probes missing with its reason."""
    import ctypes

    from .probes import TAILS

    BPF = _bpf_class()
    on = {s.name for s in plan.enabled()}
    for array, index, fn, users in TAILS:
        users = [u for u in users if u in on]
        if not users:
            continue
        try:
            f = bpf.load_func(fn.encode(), BPF.TRACEPOINT)
            bpf[array.encode()][ctypes.c_int(index)] = ctypes.c_int(f.fd)
        except Exception as e:  # bcc raises bare Exception with the kernel's reason
            for u in users:
                plan.mark(u, MISSING, f"load {fn} (tail-called by its program): {e}",
                          "mcp-agent probes --dump shows the source and flags")


def drop_ahead() -> None:
    """Wait for a compile begun ahead and not taken, and free it."""
    _take_ahead(None)


def load(plan: ProbePlan, settings: dict[str, int], progress: Callable[[str], None] | None = None,
         extra_cflags: tuple[str, ...] = ()) -> list[Loaded]:
    """Compile the unit once with every enabled probe, then attach the tracepoint probes one by one.
    Statuses in `plan` are updated in place; a failed compile marks every enabled probe missing.
    Probes of other kinds (uprobes) are attached later by their own module. extra_cflags: for tests
    (-DMCP_TEST_TP_RAW_EXEC=1 compiles health.bpf.c's capture on sched:sched_process_exec)."""
    enabled = plan.enabled()
    if not enabled:
        return []
    try:
        # the split is decided where a compile begins: not part of the key, since the memory left
        # (split_for) is lower once the compile ahead has run
        key = (unit_source(), tuple(cflags_for(plan, settings) + list(extra_cflags)))
        got = _take_ahead(key)
        if got is None:
            _check_header_tree()
            got = _compile(key[0], list(key[1]), _begin(key[0], list(key[1]), split_for(plan)), progress)
        bpf, secs, processes = got
    except LoadError as e:
        for spec in enabled:
            plan.mark(spec.name, MISSING, str(e), "check kernel headers (mcp-agent probes --dump shows the source and flags)")
        return []
    # beside the attaches, not before them: ~20 ms here, more on a GPU host, none of it needed to start
    try:
        threading.Thread(target=release_compiler_memory, name="bpf-compile-release", daemon=True).start()
    except RuntimeError:  # no thread (TasksMax): released here
        release_compiler_memory()
    _fill_tails(bpf, plan)
    for spec in enabled:
        if spec.kind not in TRACEPOINT_KINDS or plan.statuses[spec.name].state == MISSING:
            continue
        try:
            bpf.attach_tracepoint(tp=spec.tracepoint.encode(), fn_name=spec.fn_name.encode())
            plan.mark(spec.name, ATTACHED, "")
        except Exception as e:  # bcc raises bare Exception with the kernel's reason
            plan.mark(spec.name, MISSING, f"attach {spec.tracepoint}: {e}", spec.hint)
    return [Loaded(bpf, UNIT_NAME, secs, processes)]
