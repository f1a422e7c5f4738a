"""The unit's maps made without a compile: a start whose programs all come from the compile cache
creates the maps from a description kept there too, instead of running bcc (LLVM over its prelude
and the kernel headers: 0.4 s on this VM, 0.64 s on the H100 host, the largest step left on a
cached start: docs/PERFORMANCE.md).

The description is taken from a unit bcc compiled here (describe): for each table, what the kernel
made of it (BPF_OBJ_GET_INFO_BY_FD: type, key and value size, max_entries, flags, name) and what
bcc's table classes read from libbcc (the key and leaf type descriptions, bcc's type, flags and
max_entries). The maps do not depend on the probe macros (no BPF_* table sits under an #if
MCP_PROBE_*: tests/core/test_mapset.py compares a maps-only compile with a full one), so one entry
serves every plan with the same settings. Maps are made without BTF: bcc gives the kernel the
types for bpftool's pretty-printing only; none of the unit's map types or values needs BTF
(a description naming one is refused, and the unit compiles as before).
"""

from __future__ import annotations

import json
import os

from . import bpfsys

# bcc's table classes for the map types the unit declares (include/uapi/linux/bpf.h numbers, as
# bcc.table names them); a description with another type is not made here
_HASH, _ARRAY, _PROG_ARRAY, _PERCPU_HASH, _PERCPU_ARRAY, _LRU_HASH, _LRU_PERCPU_HASH, _RINGBUF = 1, 2, 3, 5, 6, 9, 10, 27
MADE_TYPES = (_HASH, _ARRAY, _PROG_ARRAY, _PERCPU_HASH, _PERCPU_ARRAY, _LRU_HASH, _LRU_PERCPU_HASH, _RINGBUF)
FORMAT = 1  # of describe()'s entries: in the cache key
FIELDS = ("type", "key_size", "value_size", "max_entries", "map_flags")


class MapSetError(Exception):
    """The description cannot be taken or made: the unit is compiled instead (the reason in the banner)."""


def possible_cpus() -> str:
    """The kernel's possible-CPU list: per-CPU maps and ring buffers are sized by it at creation."""
    try:
        with open("/sys/devices/system/cpu/possible") as f:
            return f.read().strip()
    except OSError:
        return str(os.cpu_count())


def describe(module) -> list[dict]:
    """Every table of a compiled bcc module, as make() needs it and bcc's Table classes read it."""
    from bcc import libbcc

    from .bccglue import tables

    lib = libbcc.lib
    out = []
    for fd, name in sorted(tables(module).items(), key=lambda x: x[1]):
        info = bpfsys.map_info(fd)
        if info.type not in MADE_TYPES or info.btf_vmlinux_value_type_id:
            raise MapSetError(f"table {name}: map type {info.type} is not made without bcc")
        n = name.encode()
        mid = lib.bpf_table_id(module, n)
        out.append({"name": name, **{f: int(getattr(info, f)) for f in FIELDS},
                    "bcc_id": int(mid),
                    "bcc_type": int(lib.bpf_table_type_id(module, mid)),
                    "bcc_flags": int(lib.bpf_table_flags_id(module, mid)),
                    "bcc_max_entries": int(lib.bpf_table_max_entries_id(module, mid)),
                    "key_desc": (lib.bpf_table_key_desc(module, n) or b"").decode(),
                    "leaf_desc": (lib.bpf_table_leaf_desc(module, n) or b"").decode()})
    return out


def make(desc: list) -> dict[str, tuple[int, dict]]:
    """{table name: (fd, its description)}, every map created; MapSetError (nothing left open) if a
    description is malformed or the kernel refuses a map."""
    made: dict[str, tuple[int, dict]] = {}
    if not isinstance(desc, list) or not desc:
        raise MapSetError("no table descriptions")
    try:
        for m in desc:
            if (not isinstance(m, dict) or not isinstance(m.get("name"), str) or m.get("type") not in MADE_TYPES
                    or m.get("bcc_type") not in MADE_TYPES
                    or not all(isinstance(m.get(k), int) for k in ("bcc_id", "bcc_flags", "bcc_max_entries"))
                    or not all(isinstance(m.get(k), str) for k in ("key_desc", "leaf_desc"))):
                raise MapSetError(f"a table description the agent does not make: {str(m)[:80]}")
            if m["name"] in made:
                raise MapSetError(f"table {m['name']} described twice")
            vals = [m.get(f) for f in FIELDS]
            if not all(isinstance(v, int) and 0 <= v < 1 << 32 for v in vals):
                raise MapSetError(f"table {m['name']}: sizes out of range")
            fd, err = bpfsys.map_create(*vals, name=m["name"].encode())
            if fd < 0:
                raise MapSetError(f"table {m['name']}: BPF_MAP_CREATE: {bpfsys.why(err)}")
            made[m["name"]] = (fd, m)
            m["types"] = (_decoded(m, "key_desc"), _decoded(m, "leaf_desc"))
    except BaseException:
        close(made)
        raise
    return made


def _decoded(m: dict, desc: str):
    """The ctypes type bcc makes of a table's key or leaf description (MapSetError if it cannot)."""
    from bcc import BPF

    try:
        return BPF._decode_table_type(json.loads(m[desc]))
    except Exception as e:  # noqa: BLE001 - bcc raises bare Exception, json ValueError, ctypes TypeError
        raise MapSetError(f"table {m['name']}: {desc}: {e}") from None


def close(made: dict[str, tuple[int, dict]]) -> None:
    """Each made map's fd closed once: taken out of made before its close (a second cleanup, atexit's,
    must not close a number since reused)."""
    while made:
        fd, _ = made.pop(next(iter(made)))
        try:
            os.close(fd)
        except OSError:
            pass


def table(bpf, m: dict, fd: int, keytype=None, leaftype=None, reducer=None):
    """bcc's table object for a made map. bcc's constructors read the type, flags and max_entries from
    libbcc by the module, which a made unit lacks (libbcc answers -1 and 0 for no module): set from the
    description after."""
    from bcc import table as T

    cls = {_HASH: T.HashTable, _ARRAY: T.Array, _PROG_ARRAY: T.ProgArray, _PERCPU_HASH: T.PerCpuHash, _PERCPU_ARRAY: T.PerCpuArray,
           _LRU_HASH: T.LruHash, _LRU_PERCPU_HASH: T.LruPerCpuHash, _RINGBUF: T.RingBuf}[m["bcc_type"]]
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
