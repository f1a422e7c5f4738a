"""The BPF unit compiled once and kept in the compile cache (core/loader.py, core/compile_cache.py).

A cached start's programs come back with the compiling process's map fds in their instructions; the
agent rewrites them to its maps of the same names and loads them. Checked with the kernel's own record
of which maps a loaded program uses (BPF_OBJ_GET_INFO_BY_FD: map_ids), and with entries that lie.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import signal
import struct
import sys
import time

import pytest

from mcp_hostagent.core import bccglue, compile_cache, loader, probes
from mcp_hostagent.registry import UNIT

BPF_OBJ_GET_INFO_BY_FD = 15  # include/uapi/linux/bpf.h enum bpf_cmd
_libc = ctypes.CDLL(None, use_errno=True)
_NR_BPF = 321  # x86_64


def _info(fd: int, size: int, map_ids: ctypes.Array | None = None) -> bytes:
    """struct bpf_prog_info / bpf_map_info of fd (the first `size` bytes). For a program, map_ids
    receives its maps' ids (info.nr_map_ids at 52, info.map_ids at 56)."""
    info = ctypes.create_string_buffer(size)
    if map_ids is not None:
        struct.pack_into("<IQ", info, 52, len(map_ids), ctypes.addressof(map_ids))
    attr = struct.pack("<IIQ", fd, size, ctypes.addressof(info))
    abuf = ctypes.create_string_buffer(attr, len(attr))
    if _libc.syscall(_NR_BPF, BPF_OBJ_GET_INFO_BY_FD, abuf, len(attr)) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return info.raw


def prog_map_ids(fd: int) -> set[int]:
    ids = (ctypes.c_uint32 * 64)()
    n = struct.unpack_from("<I", _info(fd, 64 + 16, ids), 52)[0]
    assert n <= 64
    return set(ids[:n])


def map_id(fd: int) -> int:
    return struct.unpack_from("<I", _info(fd, 8), 4)[0]


# ---- the rewrite, on hand-made instructions ----

def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def imm_of(b: bytes, i: int) -> int:
    return struct.unpack_from("<i", b, 8 * i + 4)[0]


def test_map_references_are_rewritten_and_nothing_else():
    prog = bytearray(insn(0x18, dst=1, src=1, imm=7) + insn(0) +   # ld_imm64 r1 = map fd 7
                     insn(0x18, dst=2, imm=7) + insn(0) +          # ld_imm64 r2 = 7, a plain constant
                     insn(0xb7, dst=0, imm=7) +                    # mov r0, 7
                     insn(0x18, dst=3, src=1, imm=9) + insn(0) +   # ld_imm64 r3 = map fd 9
                     insn(0x95))                                   # exit
    loader._rebind_maps("p", prog, {"7": "a", "9": "b"}, {"a": 42, "b": 43}.__getitem__)
    assert [imm_of(prog, i) for i in range(8)] == [42, 0, 7, 0, 7, 43, 0, 0]


@pytest.mark.parametrize("prog,why", [
    (insn(0x18, dst=1, src=1, imm=5) + insn(0), "map fd 5 (not a table)"),        # not one of the compiler's tables
    (insn(0x18, dst=1, src=1, imm=7) + insn(0), "map fd 7 (a) has no map here"),  # a table we lack
    (insn(0x18, dst=1, src=2, imm=7) + insn(0), "src_reg 2"),                      # BPF_PSEUDO_MAP_VALUE
])
def test_a_reference_that_cannot_be_moved_is_refused(prog, why):
    with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
        loader._rebind_maps("p", bytearray(prog), {"7": "a"}, lambda t: -1)


def test_the_entry_quiets_bccs_escape_warnings_and_no_others():
    """bcc 0.26's bcc/__init__.py warns about its escape sequences each time a Python it was not
    byte-compiled for compiles it: two lines on every start on the GPU host (Python 3.12, bcc
    unpacked). Compiled here from the real file, as the import does: warned without the filter,
    silent with it, while the same warning from another file still shows."""
    import importlib.util
    import warnings

    from mcp_hostagent import entry

    path = importlib.util.find_spec("bcc").origin
    src = open(path).read()

    def warned(fn) -> list[str]:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fn()
            compile(src, path, "exec")
            compile("pattern = b'^.*\\.cold$'\n", "/srv/app/serve.py", "exec")
        return [f"{w.filename}: {w.message}" for w in seen if "invalid escape sequence" in str(w.message)]

    before = warned(lambda: None)
    assert any(w.startswith(path) for w in before), before  # this bcc has the strings: the check can fail
    assert warned(entry.quiet_bcc_escape_warnings) == ["/srv/app/serve.py: invalid escape sequence '\\.'"]


def test_every_uprobe_program_is_known_as_kprobe_type_and_nothing_else():
    """loader.KPROBE_PROGRAM finds the programs whose context is struct pt_regs in the unit's text:
    each libcuda symbol's entry and return program (cuda/symbols.py), and no tracepoint program."""
    from mcp_hostagent.cuda.symbols import SYMBOLS

    found = UNIT.kprobe_programs()
    assert found == {s.entry for s in SYMBOLS} | {s.ret for s in SYMBOLS if s.ret}
    assert not found & {s.fn_name for s in UNIT.plan(disabled=(), exists=lambda cat, ev: True).enabled() if s.kind in probes.TRACEPOINT_KINDS}


@pytest.mark.bpf  # bcc's version and library are part of the key
def test_the_cache_key_follows_what_a_compile_reads(monkeypatch, tmp_path):
    """Text, flags, the headers of its -I directories (bpf/mcp_records.h) and each tracepoint's
    format (bcc builds TRACEPOINT_PROBE's args from it)."""
    (tmp_path / "mcp_records.h").write_text("struct r { int a; };\n")
    flags = ["-DA=1", f"-I{tmp_path}"]
    k = compile_cache.key("unit", flags, ["sched:sched_switch"])
    assert k == compile_cache.key("unit", flags, ["sched:sched_switch"])
    assert k != compile_cache.key("unit2", flags, ["sched:sched_switch"])
    assert k != compile_cache.key("unit", ["-DA=2", f"-I{tmp_path}"], ["sched:sched_switch"])
    (tmp_path / "mcp_records.h").write_text("struct r { long a; };\n")
    k2 = compile_cache.key("unit", flags, ["sched:sched_switch"])
    assert k2 != k
    monkeypatch.setattr(compile_cache, "_format", lambda tp: "name: sched_switch\nfield:int x; offset:99;")
    assert k2 != compile_cache.key("unit", flags, ["sched:sched_switch"])


def test_no_two_probes_the_loader_attaches_share_a_tracepoint():
    """bcc keeps one perf-event fd per tracepoint name (BPF.tracepoint_fds): a second program attached
    to the same tracepoint overwrites the first's fd, which then is never detached and stays attached
    for the life of the process (an in-process agent started 64 times filled sched_process_exit's
    64 program slots: E2BIG for every later attach). One program per tracepoint, doing what each needs."""
    from collections import Counter

    tps = Counter(p.tracepoint for p in UNIT.probes if p.kind in probes.TRACEPOINT_KINDS)
    assert not {tp: n for tp, n in tps.items() if n > 1}


# ---- real compiles ----

def _load(monkeypatch, extra_cflags: tuple[str, ...] = (), cache: str = "off"):
    from mcp_hostagent.config import load_config
    from mcp_hostagent.core import kernel

    cfg = load_config(None, env={})
    kernel.prepare(cfg.kernel_headers, cfg.kernel_link_modules_build, report=False)
    monkeypatch.setenv(compile_cache.ENV, cache)
    plan = UNIT.plan(cfg)
    (got,) = loader.load(UNIT, plan, UNIT.settings(cfg), extra_cflags=extra_cflags)
    return got, plan


def check_adopted(got, plan) -> None:
    """Every program the cache gave uses only this process's maps (the kernel's record of the loaded
    program), every tracepoint probe's program came from there, and all of them attached."""
    from bcc import BPF

    b = got.bpf
    assert b.adopted and b.module is None, "not a start from the cache"
    ours = {map_id(fd) for fd, _ in b.made.values()}  # made: core/mapset.py
    tps = [s for s in plan.enabled() if s.kind in probes.TRACEPOINT_KINDS]
    assert set(b.adopted) >= {s.fn_name.encode() for s in tps}
    kprobes = UNIT.kprobe_programs()
    for name in b.adopted:
        kind = BPF.KPROBE if name.decode() in kprobes else BPF.TRACEPOINT
        used = prog_map_ids(b.load_func(name, kind).fd)
        assert used and used <= ours, (name, used, ours)
    attached = {n for n, st in plan.statuses.items() if st.state == probes.ATTACHED}
    assert {s.name for s in tps if s.name in attached} == {s.name for s in tps if plan.statuses[s.name].reason == ""}


def _stored(cache) -> list:
    return sorted(cache.glob("*.json"))


@pytest.mark.bpf
def test_a_program_the_kernel_refused_at_the_check_is_not_loaded_again(monkeypatch):
    """_load_all checks the unit's programs before it is used or cached; a refusal is kept on the BPF
    object and the attach's load_func raises it without a second load (bcc would print its verifier
    log twice). The refusal is the kernel's: exit with r0 unset."""
    from mcp_hostagent.core import bpfsys

    cls = bccglue.bpf_class()
    b = cls.__new__(cls)  # no compile: only the load path is under test
    b.refused, b.funcs = {}, {}
    b.adopt({b"mcp_refused": insn(0x95)}, b"GPL", 0)
    loads = []
    real = bpfsys.prog_load
    monkeypatch.setattr(bpfsys, "prog_load", lambda *a, **k: loads.append(a) or real(*a, **k))
    why = loader._load_all(b, {b"mcp_refused": insn(0x95)}, set(), {"license": "GPL", "kern_version": 0})
    assert len(why) == 1 and why[0].startswith("mcp_refused: ") and len(loads) == 1, (why, loads)
    with pytest.raises(Exception) as e:
        b.load_func(b"mcp_refused", cls.TRACEPOINT)
    assert str(e.value) == b.refused[b"mcp_refused"] and len(loads) == 1
    assert "EACCES" in str(e.value) or "EINVAL" in str(e.value), str(e.value)


@pytest.mark.bpf
def test_programs_load_side_by_side_and_what_a_thread_raises_reaches_the_caller(monkeypatch):
    """_load_all: the programs in LOAD_THREADS threads (the verifier runs inside bpf(2), without the
    GIL); an exception in a thread (a damaged entry's KeyError) is raised in the caller's."""
    import threading

    seen, gate = set(), threading.Barrier(loader.LOAD_THREADS, timeout=5)

    def fake(bpf, name, insns, kprobe, kept):
        if threading.get_ident() not in seen:
            seen.add(threading.get_ident())
            gate.wait()  # every thread in at once: they run side by side, or this times out
        if name == b"boom":
            raise KeyError("license")
        return ""

    monkeypatch.setattr(loader, "_load_one", fake)
    funcs = {f"p{i}".encode(): b"" for i in range(16)}
    assert loader._load_all(None, funcs, set(), {}) == []
    assert len(seen) == loader.LOAD_THREADS
    seen.clear()
    gate.reset()
    with pytest.raises(KeyError):
        loader._load_all(None, {**funcs, b"boom": b""}, set(), {})


@pytest.mark.bpf
def test_the_compile_cache_makes_a_start_without_llvm_and_refuses_what_it_cannot_trust(monkeypatch, tmp_path):
    """A second start makes the maps from their description and loads every program from the cache
    (no module: bcc compiled nothing), the uprobe programs too, on its own maps; a damaged entry is a
    miss; an entry whose program no longer fits (a map it names is gone, or the verifier refuses it)
    is dropped and the unit compiled; a directory others can write is not used at all."""
    cache = tmp_path / "cache"
    got, plan = _load(monkeypatch, cache=str(cache))
    kprobes = UNIT.kprobe_programs()
    compiled = set(bccglue.programs(got.bpf.module)["funcs"])
    got.bpf.cleanup()
    assert got.processes == "compiled"
    (entry,) = _stored(cache)
    assert oct(cache.stat().st_mode & 0o777) == "0o700" and oct(entry.stat().st_mode & 0o777) == "0o600"
    kept = json.loads(entry.read_text())["reply"]
    assert set(kept["funcs"]) == compiled and kprobes <= compiled and kept["maps_desc"]

    got, plan = _load(monkeypatch, cache=str(cache))
    try:
        assert got.processes == "from the compile cache", got.processes
        check_adopted(got, plan)
        single, plan1 = _load(monkeypatch)
        single.bpf.cleanup()
        assert {n: st.state for n, st in plan.statuses.items()} == {n: st.state for n, st in plan1.statuses.items()}
    finally:
        got.bpf.cleanup()

    entry.write_text("{not json")  # damaged: a miss, compiled and written again
    got, _ = _load(monkeypatch, cache=str(cache))
    got.bpf.cleanup()
    assert got.processes == "compiled" and json.loads(entry.read_text())["key"] == entry.stem

    e = json.loads(entry.read_text())
    e["reply"]["maps"] = {fd: "no_such_table" for fd in e["reply"]["maps"]}
    entry.write_text(json.dumps(e))
    got, _ = _load(monkeypatch, cache=str(cache))
    got.bpf.cleanup()
    assert got.processes.startswith("compiled; compiled (the cache's entry: "), got.processes
    assert "no_such_table" in got.processes

    # a cached program the kernel refuses (exit with r0 unset), a tracepoint's or a uprobe's (checked as
    # a kprobe program): dropped, compiled again
    for pick in (lambda f: sorted(set(f) - kprobes)[0], lambda f: sorted(kprobes)[0]):
        got, _ = _load(monkeypatch, cache=str(cache))  # cached again
        got.bpf.cleanup()
        (entry,) = _stored(cache)
        e = json.loads(entry.read_text())
        name = pick(e["reply"]["funcs"])
        e["reply"]["funcs"][name] = base64.b64encode(insn(0x95)).decode()
        entry.write_text(json.dumps(e))
        got, _ = _load(monkeypatch, cache=str(cache))
        got.bpf.cleanup()
        assert got.processes.startswith(f"compiled; compiled (the cache's entry: {name}: "), got.processes

    cache.chmod(0o777)
    got, _ = _load(monkeypatch, cache=str(cache))
    got.bpf.cleanup()
    assert got.processes.startswith("compiled; compile cache not used: "), got.processes
    assert "writable by no one else" in got.processes
    # ours, but under a directory others can change (not sticky): someone could swap it
    cache.chmod(0o700)
    tmp_path.chmod(0o777)
    try:
        got, _ = _load(monkeypatch, cache=str(cache))
        got.bpf.cleanup()
    finally:
        tmp_path.chmod(0o700)
    assert "a directory above the cache that others can change" in got.processes, got.processes


@pytest.mark.bpf
def test_a_symlinked_entry_is_refused_and_the_unit_compiled(monkeypatch, tmp_path):
    cache = tmp_path / "cache"
    got, _ = _load(monkeypatch, cache=str(cache))
    got.bpf.cleanup()
    (entry,) = _stored(cache)
    real = tmp_path / "elsewhere.json"
    entry.rename(real)
    entry.symlink_to(real)
    got, plan = _load(monkeypatch, cache=str(cache))
    try:
        assert got.processes.startswith("compiled; compile cache not used: "), got.processes
        assert got.bpf.module is not None and "symbolic links" in got.processes, got.processes  # O_NOFOLLOW: ELOOP
    finally:
        got.bpf.cleanup()


@pytest.mark.bpf
def test_a_compile_begun_ahead_is_taken_by_the_load_of_the_same_unit(monkeypatch, tmp_path):
    """`run` begins the compile in a thread before importing the pipeline; load() with the same plan
    and settings takes it, one for another plan is freed and the unit compiled for the new one."""
    from mcp_hostagent.config import load_config
    from mcp_hostagent.core import kernel

    cfg = load_config(None, env={})
    kernel.prepare(cfg.kernel_headers, cfg.kernel_link_modules_build, report=False)
    monkeypatch.setenv(compile_cache.ENV, "off")
    plan = UNIT.plan(cfg)
    loader.compile_ahead(UNIT, plan, UNIT.settings(cfg))
    job = loader._ahead
    assert job is not None and job.thread.is_alive()
    (got,) = loader.load(UNIT, plan, UNIT.settings(cfg))
    try:
        assert loader._ahead is None and got.bpf is job.result[0]
    finally:
        got.bpf.cleanup()
    loader.compile_ahead(UNIT, plan, UNIT.settings(cfg))
    job = loader._ahead
    other = UNIT.plan(cfg, disabled=["page_faults"])
    (got,) = loader.load(UNIT, other, UNIT.settings(cfg))
    try:
        assert got.bpf is not job.result[0] and other.statuses["page_faults"].state == probes.DISABLED
    finally:
        got.bpf.cleanup()
