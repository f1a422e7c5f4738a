"""The unit's maps made from the compile cache's description, without bcc's compile (core/mapset.py).

Held to what bcc itself makes: the kernel's record of each map (BPF_OBJ_GET_INFO_BY_FD) and bcc's
table objects, for the agent's own unit; and a small unit's programs on made maps, run by syscalls
this test makes, counted through bcc's ring buffer, hash and per-CPU array.
"""

from __future__ import annotations

import ctypes
import os
import threading

import pytest

from mcp_hostagent.core import bccglue, bpfsys, loader, mapset, probes
from mcp_hostagent.registry import UNIT as AGENT_UNIT

pytestmark = pytest.mark.bpf


def _compiled(probe_macros: bool, text: str | None = None):
    from mcp_hostagent.config import load_config
    from mcp_hostagent.core import kernel

    cfg = load_config(None, env={})
    kernel.prepare(cfg.kernel_headers, cfg.kernel_link_modules_build, report=False)
    if text is not None:
        return bccglue.bpf_class()(text=text.encode())
    flags = AGENT_UNIT.cflags(AGENT_UNIT.plan(disabled=()), AGENT_UNIT.settings(cfg))
    flags = flags if probe_macros else [f for f in flags if not f.startswith("-DMCP_PROBE_")]
    return bccglue.bpf_class()(text=AGENT_UNIT.text().encode(), cflags=flags)


def _kernel_view(fd: int) -> dict:
    i = bpfsys.map_info(fd)
    return {f: getattr(i, f) for f in mapset.FIELDS} | {"name": i.name}


def test_the_units_maps_are_made_as_bcc_makes_them_and_do_not_depend_on_the_probes():
    full, maps_only = _compiled(True), _compiled(False)
    try:
        desc = bccglue.describe(maps_only.module)
        assert desc == bccglue.describe(full.module)  # one entry serves every plan
        assert {m["name"] for m in desc} == set(bccglue.tables(full.module).values())
        made = bccglue.bpf_class().from_maps(desc)
        try:
            # bcc's state, as its constructor leaves it before the compile (attach, detach, cleanup read it)
            assert set(vars(full)) <= set(vars(made)), set(vars(full)) - set(vars(made))
            assert made.module is None and not made.funcs and not made.tables
            for m in desc:
                name = m["name"].encode()
                theirs, ours = full[name], made[name]
                assert _kernel_view(ours.map_fd) == _kernel_view(theirs.map_fd), name
                assert type(ours) is type(theirs), name
                for attr in ("ttype", "flags", "max_entries", "map_id", "_name"):
                    assert getattr(ours, attr) == getattr(theirs, attr), (name, attr)
                for t in ("Key", "Leaf"):
                    a, b = getattr(ours, t), getattr(theirs, t)
                    names = [[f[0] for f in getattr(x, "_fields_", ())] for x in (a, b)]
                    assert ctypes.sizeof(a) == ctypes.sizeof(b) and names[0] == names[1], (name, t)
        finally:
            made.cleanup()
        assert not made.made  # every map fd closed
    finally:
        full.cleanup()
        maps_only.cleanup()


def test_a_description_it_cannot_trust_makes_nothing_and_leaves_nothing_open():
    b = _compiled(False)
    try:
        desc = bccglue.describe(b.module)
    finally:
        b.cleanup()
    before = len(os.listdir("/proc/self/fd"))
    bad_size = [dict(m) for m in desc]
    ring = next(m for m in bad_size if m["type"] == 27)
    ring["max_entries"] = 4097  # a ring buffer's size must be a power-of-2 multiple of the page: EINVAL
    bad_desc = [dict(m) for m in desc]
    bad_desc[-1]["leaf_desc"] = "[not json"
    other_type = [dict(m) for m in desc]
    other_type[0]["type"] = 4  # a perf event array: not made here
    no_flags = [dict(m) for m in desc]
    del no_flags[1]["bcc_flags"]
    twice = desc + [dict(desc[0])]
    for wrong, why in ((bad_size, "BPF_MAP_CREATE: EINVAL"), (bad_desc, "leaf_desc"),
                       (other_type, "does not make"), (no_flags, "does not make"), (twice, "described twice"),
                       ([], "no table"), ({"maps": 1}, "no table")):
        with pytest.raises(mapset.MapSetError) as e:
            bccglue.bpf_class().from_maps(wrong)
        assert why in str(e.value), str(e.value)
        assert len(os.listdir("/proc/self/fd")) == before


UNIT = """
struct rec { u32 tid; u32 n; };
BPF_RINGBUF_OUTPUT(out, 1);
BPF_HASH(seen, u32, struct rec, 64);
BPF_PERCPU_ARRAY(calls, u64, 2);
BPF_ARRAY(target, u32, 1);

TRACEPOINT_PROBE(syscalls, sys_enter_getppid) {
    int zero = 0;
    u32 *want = target.lookup(&zero);
    u32 tid = (u32)bpf_get_current_pid_tgid();
    if (!want || *want != tid)
        return 0;
    struct rec r = {.tid = tid}, *cur = seen.lookup(&tid);
    r.n = cur ? cur->n + 1 : 1;
    seen.update(&tid, &r);
    calls.increment(zero);
    out.ringbuf_output(&r, sizeof(r), 0);
    return 0;
}
"""


def test_a_units_programs_on_made_maps_count_the_syscalls_this_test_makes():
    """A unit bcc compiled is described and its instructions kept (as the compile cache keeps them); a
    unit made from both attaches, and every getppid(2) of this thread reaches the ring buffer, the hash
    and the per-CPU array through bcc's own table classes."""
    compiled = _compiled(False, UNIT)
    try:
        desc, reply = bccglue.describe(compiled.module), bccglue.programs(compiled.module)
    finally:
        compiled.cleanup()
    made = bccglue.bpf_class().from_maps(desc)
    try:
        made.adopt(loader._rebound(made, reply), reply["license"].encode(), int(reply["kern_version"]))
        made.attach_tracepoint(tp=b"syscalls:sys_enter_getppid", fn_name=b"tracepoint__syscalls__sys_enter_getppid")
        got = []
        class Rec(ctypes.Structure):
            _fields_ = [("tid", ctypes.c_uint32), ("n", ctypes.c_uint32)]

        made[b"out"].open_ring_buffer(lambda ctx, data, size: got.append((size, ctypes.cast(data, ctypes.POINTER(Rec))[0].n)))
        n, calls, done = 37, [0], threading.Event()

        def caller():
            made[b"target"][ctypes.c_int(0)] = ctypes.c_uint32(threading.get_native_id())
            for _ in range(n):
                os.getppid()
                calls[0] += 1
            done.set()

        t = threading.Thread(target=caller)
        t.start()
        t.join()
        made.ring_buffer_consume()
        tid = made[b"target"][ctypes.c_int(0)].value
        assert done.is_set() and calls[0] == n
        assert got == [(8, i) for i in range(1, n + 1)]
        assert made[b"seen"][ctypes.c_uint32(tid)].n == n
        assert sum(made[b"calls"][ctypes.c_int(0)]) == n
        assert [k.value for k in made[b"seen"].keys()] == [tid]
    finally:
        made.cleanup()
