"""The one place that reaches into bcc: its BPF class made to attach probes one by one and to run on
maps and programs from the compile cache (the maps' description read from libbcc, bcc's tables over
maps core/mapset.py made), the compile with LLVM's diagnostics kept back, and what a
compiled module holds (its functions' instructions, its tables) read through libbcc. bcc 0.26
(Debian's python3-bpfcc); tests/core/test_mapset.py holds a made unit's state to a compiled one's.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import sys
import tempfile
import threading
import time
from typing import Callable

from . import bpfsys, mapset


def bpf_class():
    from bcc import BPF

    class ManualAttachBPF(BPF):
        adopted: dict[bytes, bytes] = {}
        made: dict[str, tuple[int, dict]] = {}  # table name -> (fd, description): a unit made without a compile

        def __init__(self, *args, **kwargs):
            self.refused: dict[bytes, str] = {}  # name -> the kernel's refusal at the check (loader)
            super().__init__(*args, **kwargs)

        @classmethod
        def from_maps(cls, desc: list) -> "ManualAttachBPF":
            """A unit with no module: its maps made from the description (core/mapset.py), its programs
            all adopted. mapset.MapSetError if the maps cannot be made."""
            self = cls.__new__(cls)
            self.refused = {}
            # BPF.__init__'s state before its compile: what attach, detach and cleanup read
            for a in ("kprobe_fds", "uprobe_fds", "tracepoint_fds", "raw_tracepoint_fds", "kfunc_entry_fds",
                      "kfunc_exit_fds", "lsm_fds", "perf_buffers", "open_perf_events", "funcs", "tables"):
                setattr(self, a, {})
            self._ringbuf_manager = self.tracefile = self.module = None
            self.debug = 0
            self.made = mapset.make(desc)
            try:  # the ctypes types bcc makes of each table's key and leaf, as its own compile would
                for _, m in self.made.values():
                    m["types"] = (_decoded(m, "key_desc"), _decoded(m, "leaf_desc"))
            except BaseException:
                mapset.close(self.made)
                raise
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
            return table(self, m, fd, keytype, leaftype, reducer)

        def cleanup(self):
            try:
                super().cleanup()
            finally:  # after the ring buffers' manager is freed (it maps them)
                mapset.close(self.made)

        # bcc attaches every tracepoint__* function while constructing, and one failure raises for
        # all; the loader attaches one by one so that each probe gets its own status.
        def _trace_autoload(self):
            pass

        def adopt(self, funcs: dict[bytes, bytes], license: bytes, kern_version: int) -> None:
            """Programs from the compile cache, their map references already this object's; loaded on
            first use, as bcc loads its own."""
            self.adopted, self.adopted_license, self.adopted_kern_version = funcs, license, kern_version

        def load_func(self, func_name, prog_type, device=None, attach_type=-1):
            func_name = func_name if isinstance(func_name, bytes) else func_name.encode()
            if func_name in self.refused:  # checked once already: bcc would print its verifier log again
                raise Exception(self.refused[func_name])
            insns = self.adopted.get(func_name)
            if insns is None or func_name in self.funcs:
                return super().load_func(func_name, prog_type, device, attach_type)
            if device is not None:
                raise Exception(f"{func_name.decode()} came from the compile cache: no offload")
            # through the syscall, not bcc_prog_load: uprobe_multi programs need an expected attach type
            fd, err = bpfsys.prog_load(prog_type, insns, self.adopted_license, self.adopted_kern_version, func_name,
                                       max(attach_type, 0))
            if fd < 0:
                raise Exception(f"Failed to load BPF program {func_name.decode()}: {bpfsys.why(err)}")
            fn = BPF.Function(self, func_name, fd)
            self.funcs[func_name] = fn
            return fn

    return ManualAttachBPF


def compile_quietly(text: str, cflags: list[str], progress: Callable[[str], None] | None, name: str):
    """(bpf, seconds): bcc's compile with fds 1 and 2 redirected (libbcc prints clang diagnostics on 2
    and some errors, such as missing headers, on 1, where --console spans go), ticking progress on
    the real fd 2. RuntimeError with the compiler's first error lines if it fails."""
    BPF = bpf_class()
    saved, saved_out = os.dup(2), os.dup(1)
    done = threading.Event()
    t0 = time.monotonic()

    def tick():
        while not done.wait(0.25):
            if progress:
                progress(f"compiling {name} with LLVM... {time.monotonic() - t0:.1f}s")

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
            raise RuntimeError(f"{e}: {'; '.join(errors[:3]) or 'no compiler error line'}") from e
        finally:
            done.set()
            os.dup2(saved, 2)
            os.dup2(saved_out, 1)
            os.close(saved)
            os.close(saved_out)
    return bpf, time.monotonic() - t0


def tables(module) -> dict[int, str]:
    """{map fd: table name} of a compiled bcc module (libbcc exports these; bcc's Python does not declare them)."""
    from bcc import libbcc

    lib = libbcc.lib
    lib.bpf_num_tables.restype, lib.bpf_num_tables.argtypes = ctypes.c_size_t, [ctypes.c_void_p]
    lib.bpf_table_name.restype, lib.bpf_table_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p, ctypes.c_size_t]
    lib.bpf_table_fd_id.restype, lib.bpf_table_fd_id.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]
    return {lib.bpf_table_fd_id(module, i): lib.bpf_table_name(module, i).decode() for i in range(lib.bpf_num_tables(module))}


def programs(module) -> dict:
    """A compiled module's programs as the compile cache keeps them: each function's instructions
    (naming this process's map fds, listed by table name), the license and kernel version."""
    import base64

    from bcc import libbcc

    lib = libbcc.lib
    funcs = {}
    for i in range(lib.bpf_num_functions(module)):
        name = lib.bpf_function_name(module, i)
        funcs[name.decode()] = base64.b64encode(
            ctypes.string_at(lib.bpf_function_start(module, name), lib.bpf_function_size(module, name))).decode()
    return {"funcs": funcs, "maps": {str(fd): name for fd, name in tables(module).items()},
            "license": lib.bpf_module_license(module).decode(), "kern_version": lib.bpf_module_kern_version(module)}


MADV_PAGEOUT = 21  # Linux >= 5.4; older kernels answer EINVAL and keep the pages
_COMPILER_LIBS = ("libLLVM", "libclang")


def release_compiler_memory(maps_path: str = "/proc/self/maps") -> None:
    """Give back what the compile left resident and the agent will not use again: clang's freed heap
    (malloc_trim) and the LLVM and clang code pages the compile touched (MADV_PAGEOUT; RSS ~163 ->
    ~70 MB, bench/bench_footprint.py). PAGEOUT only drops pages no other process maps and never loses
    data (file pages are read back), so a later compile (SIGHUP reload) faults them in again."""
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


# ---- the compile cache's maps: their description read from libbcc, bcc's tables over maps made without it ----

def describe(module) -> list[dict]:
    """Every table of a compiled bcc module, as make() needs it and bcc's Table classes read it."""
    from bcc import libbcc

    lib = libbcc.lib
    out = []
    for fd, name in sorted(tables(module).items(), key=lambda x: x[1]):
        info = bpfsys.map_info(fd)
        if info.type not in mapset.MADE_TYPES or info.btf_vmlinux_value_type_id:
            raise mapset.MapSetError(f"table {name}: map type {info.type} is not made without bcc")
        n = name.encode()
        mid = lib.bpf_table_id(module, n)
        out.append({"name": name, **{f: int(getattr(info, f)) for f in mapset.FIELDS},
                    "bcc_id": int(mid),
                    "bcc_type": int(lib.bpf_table_type_id(module, mid)),
                    "bcc_flags": int(lib.bpf_table_flags_id(module, mid)),
                    "bcc_max_entries": int(lib.bpf_table_max_entries_id(module, mid)),
                    "key_desc": (lib.bpf_table_key_desc(module, n) or b"").decode(),
                    "leaf_desc": (lib.bpf_table_leaf_desc(module, n) or b"").decode()})
    return out


def _decoded(m: dict, desc: str):
    """The ctypes type bcc makes of a table's key or leaf description (mapset.MapSetError if it cannot)."""
    from bcc import BPF

    try:
        return BPF._decode_table_type(json.loads(m[desc]))
    except Exception as e:  # noqa: BLE001 - bcc raises bare Exception, json ValueError, ctypes TypeError
        raise mapset.MapSetError(f"table {m['name']}: {desc}: {e}") from None


def table(bpf, m: dict, fd: int, keytype=None, leaftype=None, reducer=None):
    """bcc's table object for a made map. bcc's constructors read the type, flags and max_entries from
    libbcc by the module, which a made unit lacks (libbcc answers -1 and 0 for no module): set from the
    description after."""
    from bcc import table as T

    M = mapset
    cls = {M._HASH: T.HashTable, M._ARRAY: T.Array, M._PROG_ARRAY: T.ProgArray, M._PERCPU_HASH: T.PerCpuHash,
           M._PERCPU_ARRAY: T.PerCpuArray, M._LRU_HASH: T.LruHash, M._LRU_PERCPU_HASH: T.LruPerCpuHash,
           M._RINGBUF: T.RingBuf}[m["bcc_type"]]
    name = m["name"].encode()
    keytype, leaftype = keytype or m["types"][0], leaftype or m["types"][1]
    if cls in (T.PerCpuHash, T.PerCpuArray, T.LruPerCpuHash):
        t = cls(bpf, m["bcc_id"], fd, keytype, leaftype, reducer=reducer)
    elif cls is T.RingBuf:
        t = cls(bpf, m["bcc_id"], fd, keytype, leaftype, name)
    else:
        t = cls(bpf, m["bcc_id"], fd, keytype, leaftype)
    t.ttype, t.flags, t.max_entries = m["bcc_type"], m["bcc_flags"], m["bcc_max_entries"]
    return t
