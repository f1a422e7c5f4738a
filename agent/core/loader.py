"""Compile the BPF unit (core/unit.py: the capabilities' sources) with bcc (LLVM at start-up), keep its
programs and maps' description in the compile cache, and attach its probes one by one.

A start whose unit (text, flags, bcc, kernel, headers, tracepoint formats: compile_cache.key) is in
the cache makes the maps from their description (core/mapset.py) and loads the kept programs,
their map references rewritten to the new maps: no LLVM at all. Otherwise bcc compiles the unit
here, in one process; `run` begins that compile in a thread before it imports the pipeline
(compile_ahead: libbcc holds no GIL while LLVM runs, so the OTel SDK's import overlaps it). bcc is
imported here and in core/bccglue.py only, after tracefs is mounted (bcc picks its tracefs path at
import time).
"""

from __future__ import annotations

import base64
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable

from . import bccglue, bpfsys, compile_cache, mapset
from .probes import ATTACHED, MISSING, TRACEPOINT_KINDS, ProbePlan
from .unit import NAME as UNIT_NAME, Unit


class LoadError(RuntimeError):
    pass


@dataclass
class Loaded:
    bpf: object  # bcc.BPF
    program: str
    compile_s: float
    processes: str = ""  # how: "compiled", "from the compile cache", and any note


BPF_LD_IMM64, BPF_PSEUDO_MAP_FD = 0x18, 1  # include/uapi/linux/bpf.h
LOAD_THREADS = 4  # programs verified side by side on a cached start: bpf(2) runs without the GIL


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


def _rebind_maps(name: str, insns: bytearray, their_maps: dict[str, str], fd_of: Callable[[str], int]) -> None:
    """Rewrite each map reference (ld_imm64 with BPF_PSEUDO_MAP_FD: the compiling process's fd) to this
    process's map of the same name. Any other pseudo load would name an object we cannot move."""
    i = 0
    while i + 8 <= len(insns):
        if insns[i] == BPF_LD_IMM64:
            src = insns[i + 1] >> 4
            if src == BPF_PSEUDO_MAP_FD:
                theirs = int.from_bytes(insns[i + 4:i + 8], "little", signed=True)
                table = their_maps.get(str(theirs))
                mine = fd_of(table) if table else -1
                if mine < 0:
                    raise ValueError(f"{name}: map fd {theirs} ({table or 'not a table'}) has no map here")
                insns[i + 4:i + 8] = mine.to_bytes(4, "little", signed=True)
            elif src:
                raise ValueError(f"{name}: ld_imm64 with src_reg {src} cannot be moved between processes")
            i += 16
        else:
            i += 8


def _rebound(bpf, kept: dict) -> dict[bytes, bytes]:
    """The kept programs, their map references rewritten to bpf's maps."""
    funcs = {}
    for name, b64 in kept["funcs"].items():
        insns = bytearray(base64.b64decode(b64))
        _rebind_maps(name, insns, kept["maps"], bpf.table_fd)
        funcs[name.encode()] = bytes(insns)
    return funcs


def _load_one(bpf, name: bytes, insns: bytes, kprobe: bool, kept: dict) -> str:
    """Load a program: a tracepoint's is kept (attach uses it); a kprobe-type one (a uprobe) is loaded
    and closed again, since its attach mechanism (cuda/uprobes.py) picks how it is loaded. Why it
    failed, or ""."""
    if kprobe:
        fd, err = bpfsys.prog_load(bpfsys.BPF_PROG_TYPE_KPROBE, insns, kept["license"].encode(),
                                   int(kept["kern_version"]), name)
        if fd < 0:
            return f"{name.decode()}: {bpfsys.why(err)}"
        os.close(fd)
        return ""
    try:
        bpf.load_func(name, type(bpf).TRACEPOINT)
    except Exception as e:  # noqa: BLE001 - bcc raises bare Exception with the kernel's reason
        bpf.refused[name] = str(e)  # the attach reports this, without a second load
        return f"{name.decode()}: {e}"
    return ""


def _load_all(bpf, funcs: dict[bytes, bytes], kprobes: set[str], kept: dict) -> list[str]:
    """Every program loaded, LOAD_THREADS side by side (the verifier runs inside bpf(2), which ctypes
    calls without the GIL): what failed, and why."""
    items = list(funcs.items())
    out: list = []
    lock = threading.Lock()

    def run(chunk):
        for name, insns in chunk:
            try:
                why = _load_one(bpf, name, insns, name.decode() in kprobes, kept)
            except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
                why = e
            if why:
                with lock:
                    out.append(why)

    chunks = [items[i::LOAD_THREADS] for i in range(LOAD_THREADS)]
    threads = []
    for c in chunks[1:]:
        t = threading.Thread(target=run, args=(c,), name="mcp-bpf-load", daemon=True)
        try:
            t.start()
            threads.append(t)
        except RuntimeError:  # no thread (TasksMax): this one loads it
            run(c)
    try:
        run(chunks[0])
    finally:  # ^C included: the caller frees the BPF object these threads load from
        for t in threads:
            t.join()
    for x in out:
        if isinstance(x, BaseException):
            raise x
    return out


def _from_cache(cache: str, k: str, kprobes: set[str]):
    """The unit made from the compile cache's entry k: (bpf, note), (None, note) when there is none or
    it cannot be used (it is then dropped: a program the kernel no longer takes must not be kept)."""
    try:
        kept = compile_cache.get(cache, k)
    except (compile_cache.CacheError, OSError) as e:
        return None, f"; compile cache not used: {e}"
    if kept is None:
        return None, ""
    bpf = None
    try:
        bpf = bccglue.bpf_class().from_maps(kept["maps_desc"])
        bpf.adopt(_rebound(bpf, kept), kept["license"].encode(), int(kept["kern_version"]))
        failed = _load_all(bpf, bpf.adopted, kprobes, kept)
        if failed:
            raise ValueError(f"{failed[0]} from the compile cache")
        return bpf, ""
    except (mapset.MapSetError, ValueError, KeyError, TypeError, AttributeError, OSError) as e:
        compile_cache.drop(cache, k)
        if bpf is not None:
            bpf.cleanup()
        return None, f"; compiled (the cache's entry: {e})"


def _compile(text: str, cflags: list[str], tracepoints: list[str], kprobes: set[str],
             progress: Callable[[str], None] | None):
    """(bpf, seconds, how): from the compile cache, else compiled here (and kept for the next start
    if every program loads)."""
    t0 = time.monotonic()
    cache, note, k = compile_cache.directory(), "", None
    if cache:
        try:
            k = compile_cache.key(text, cflags, tracepoints, {"maps": mapset.FORMAT, "cpus": mapset.possible_cpus()})
        except (compile_cache.CacheError, OSError, ValueError) as e:
            cache, note = None, f"; compile cache not used: {e}"
    if cache and k:
        bpf, note = _from_cache(cache, k, kprobes)
        if bpf is not None:
            return bpf, time.monotonic() - t0, "from the compile cache"
    try:
        bpf, _ = bccglue.compile_quietly(text, cflags, progress, UNIT_NAME)
    except RuntimeError as e:
        raise LoadError(f"compile {UNIT_NAME}: {e}") from e
    if cache and k:
        try:
            kept = bccglue.programs(bpf.module)
            # loaded now (attach would, a moment later): a program that fails is not kept, and its
            # probe reports the verifier's error at attach
            funcs = {n.encode(): base64.b64decode(i) for n, i in kept["funcs"].items()}
            if not _load_all(bpf, funcs, kprobes, kept):
                kept["maps_desc"] = bccglue.describe(bpf.module)
                compile_cache.put(cache, k, kept)
        except (compile_cache.CacheError, mapset.MapSetError, OSError) as e:
            note += f"; compile cache not written: {e}"
    return bpf, time.monotonic() - t0, "compiled" + note


class _Ahead:
    """A compile begun before it is needed (compile_ahead), taken by the load() it was begun for."""

    def __init__(self, key: tuple, progress):
        self.key, self.result, self.error = key, None, None
        self.thread = threading.Thread(target=self._run, args=(progress,), name="bpf-compile", daemon=True)

    def _run(self, progress) -> None:
        try:
            self.result = _compile(*_args(self.key), progress)
        except LoadError as e:
            self.error = e
        except Exception:  # noqa: BLE001 - bcc not importable, say: load() compiles again and reports it
            pass


_ahead: _Ahead | None = None


def _key(unit: Unit, plan: ProbePlan, settings: dict[str, int], extra_cflags: tuple[str, ...] = ()) -> tuple:
    text = unit.text()
    return (text, tuple(unit.cflags(plan, settings) + list(extra_cflags)),
            tuple(s.tracepoint for s in plan.enabled() if s.kind in TRACEPOINT_KINDS),
            tuple(sorted(unit.kprobe_programs(text))))


def _args(key: tuple) -> tuple:
    return key[0], list(key[1]), list(key[2]), set(key[3])


def compile_ahead(unit: Unit, plan: ProbePlan, settings: dict[str, int],
                  progress: Callable[[str], None] | None = None) -> None:
    """Begin compiling the unit in a thread; load() with the same plan and settings takes the result.
    `run` calls this before importing the pipeline, so the two overlap. libbcc 0.26 cannot compile two
    units at once (a SIGSEGV, seen): load() waits for this one."""
    global _ahead
    if _ahead is not None or not plan.enabled():
        return
    try:
        _check_header_tree()
        # bcc imported here, before the thread: imported in it, it would share the GIL with the
        # pipeline's import that runs meanwhile, and the compile (which holds no GIL) would begin late
        bccglue.bpf_class()
    except Exception:  # noqa: BLE001 - load() does it again and reports what fails
        return
    job = _Ahead(_key(unit, plan, settings), progress)
    try:
        job.thread.start()
    except RuntimeError:  # no thread (TasksMax): load() compiles
        return
    _ahead = job


def compile_ahead_for(unit: Unit, cfg, progress: Callable[[str], None] | None = None) -> None:
    """`run`: the compile Agent.start will load, begun now (tracefs and headers as Agent.start finds
    them; it repeats both and reports what fails)."""
    from . import kernel

    try:
        kernel.prepare(cfg.kernel_headers, cfg.kernel_link_modules_build, report=False)  # Agent.start logs
    except kernel.KernelSetupError:
        return
    compile_ahead(unit, unit.plan(cfg), unit.settings(cfg), progress)


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


def drop_ahead() -> None:
    """Wait for a compile begun ahead and not taken, and free it."""
    _take_ahead(None)


def _fill_tails(bpf, unit: Unit, plan: ProbePlan) -> None:
    """Each tail-called program (Declaration.tails) loaded into its prog array slot, before the probes
    that call it attach; one that fails leaves those probes missing with its reason."""
    import ctypes

    BPF = bccglue.bpf_class()
    on = {s.name for s in plan.enabled()}
    for array, index, fn, users in unit.tails:
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


def load(unit: Unit, plan: ProbePlan, settings: dict[str, int], progress: Callable[[str], None] | None = None,
         extra_cflags: tuple[str, ...] = ()) -> list[Loaded]:
    """The unit with every enabled probe (compiled, or from the compile cache), its tracepoint probes
    attached one by one. Statuses in `plan` are updated in place; a failed compile marks every enabled
    probe missing. Probes of other kinds (uprobes) are attached later by their own module.
    extra_cflags: for tests (-DMCP_TEST_TP_RAW_EXEC=1 compiles common.bpf.c's raw capture on
    sched:sched_process_exec)."""
    enabled = plan.enabled()
    if not enabled:
        return []
    try:
        key = _key(unit, plan, settings, extra_cflags)
        got = _take_ahead(key)
        if got is None:
            _check_header_tree()
            got = _compile(*_args(key), progress)
        bpf, secs, how = got
    except LoadError as e:
        for spec in enabled:
            plan.mark(spec.name, MISSING, str(e), "check kernel headers (mcp-agent probes --dump shows the source and flags)")
        return []
    # beside the attaches, not before them: none of it needed to start
    try:
        threading.Thread(target=bccglue.release_compiler_memory, name="bpf-compile-release", daemon=True).start()
    except RuntimeError:  # no thread (TasksMax): released here
        bccglue.release_compiler_memory()
    _fill_tails(bpf, unit, plan)
    for spec in enabled:
        if spec.kind not in TRACEPOINT_KINDS or plan.statuses[spec.name].state == MISSING:
            continue
        try:
            bpf.attach_tracepoint(tp=spec.tracepoint.encode(), fn_name=spec.fn_name.encode())
            plan.mark(spec.name, ATTACHED, "")
        except Exception as e:  # bcc raises bare Exception with the kernel's reason
            plan.mark(spec.name, MISSING, f"attach {spec.tracepoint}: {e}", spec.hint)
    return [Loaded(bpf, UNIT_NAME, secs, how)]
