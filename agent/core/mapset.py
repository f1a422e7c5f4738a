"""The unit's maps made without a compile: a start whose programs all come from the compile cache
creates the maps from a description kept there too, instead of running bcc (LLVM over its prelude
and the kernel headers, the largest step left on a cached start: docs/PERFORMANCE.md).

The description is taken from a unit bcc compiled here (describe): for each table, what the kernel
made of it (BPF_OBJ_GET_INFO_BY_FD: type, key and value size, max_entries, flags, name) and what
bcc's table classes read from libbcc (the key and leaf type descriptions, bcc's type, flags and
max_entries). The maps do not depend on the probe macros (no BPF_* table sits under an #if
MCP_PROBE_*: tests/core/test_mapset.py compares a maps-only compile with a full one), so one entry
serves every plan with the same settings. What reads bcc (the description, bcc's table objects over
the made maps) is core/bccglue.py's: this module only asks the kernel. Maps are made without BTF: bcc gives the kernel the
types for bpftool's pretty-printing only; none of the unit's map types or values needs BTF
(a description naming one is refused, and the unit compiles as before).
"""

from __future__ import annotations

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
    except BaseException:
        close(made)
        raise
    return made


def close(made: dict[str, tuple[int, dict]]) -> None:
    """Each made map's fd closed once: taken out of made before its close (a second cleanup, atexit's,
    must not close a number since reused)."""
    while made:
        fd, _ = made.pop(next(iter(made)))
        try:
            os.close(fd)
        except OSError:
            pass
