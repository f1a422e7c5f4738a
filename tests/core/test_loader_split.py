"""The BPF unit compiled in several processes (core/loader.py, core/compile_worker.py).

The worker's programs come back with its own map fds in their instructions; the agent rewrites them
to its maps of the same names and loads them. Checked with the kernel's own record of which maps a
loaded program uses (BPF_OBJ_GET_INFO_BY_FD: map_ids), and with a worker that fails.
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

from mcp_hostagent.core import compile_cache, compile_worker, loader, probes

BPF_OBJ_GET_INFO_BY_FD = 15  # include/uapi/linux/bpf.h enum bpf_cmd
CPU_QUOTA, LIMITS_HIDDEN = loader.cpu_quota, loader.limits_hidden  # before the fixture below replaces them


@pytest.fixture(autouse=True)
def _no_cpu_quota(monkeypatch):
    """The worker counts below are this module's, whatever CPU quota or cgroup namespace the runner
    has (the tests of those two call the originals above)."""
    monkeypatch.setattr(loader, "cpu_quota", lambda: None)
    monkeypatch.setattr(loader, "limits_hidden", lambda: False)
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
    (insn(0x18, dst=1, src=1, imm=5) + insn(0), "map fd 5 (not a table)"),        # not one of the worker's tables
    (insn(0x18, dst=1, src=1, imm=7) + insn(0), "map fd 7 (a) has no map here"),  # a table we lack
    (insn(0x18, dst=1, src=2, imm=7) + insn(0), "src_reg 2"),                      # BPF_PSEUDO_MAP_VALUE
])
def test_a_reference_that_cannot_be_moved_is_refused(prog, why):
    with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
        loader._rebind_maps("p", bytearray(prog), {"7": "a"}, lambda t: -1)


# ---- which probes the worker compiles ----

def _plan():
    return probes.plan((), exists=lambda cat, ev: True)


def _macros(parts) -> set[str]:
    return {m for p in parts for m in p.macros}


@pytest.mark.parametrize("cpus,workers", [(2, 1), (3, 2), (4, 2), (5, 4), (7, 6), (16, 6), (128, 6)])
def test_each_probe_is_in_one_part_the_first_group_naming_it(monkeypatch, cpus, workers):
    monkeypatch.delenv(loader.SPLIT_ENV, raising=False)
    monkeypatch.setattr(loader, "memcg_headroom", lambda: None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    plan = _plan()
    parts, why = loader.split_for(plan)
    theirs, here = [p for p in parts if not p.here], [p for p in parts if p.here]
    groups = loader.WORKER_GROUPS[workers]
    assert len(theirs) == len(groups) and why == ""
    by_macro = {s.macro: s for s in plan.enabled()}
    every = [m for p in parts for m in p.macros]
    assert sorted(every) == sorted(by_macro)  # every enabled probe in exactly one part
    for p, group in zip(theirs, groups):
        for m in p.macros:
            s = by_macro[m]
            first = next(g for g in groups if s.name in g or (s.kind != "uprobe" and s.program in g))
            assert first is group, (s.name, group)
    for p in parts:
        assert p.tracepoints == tuple(by_macro[m].tracepoint for m in p.macros if by_macro[m].kind != "uprobe")
    # this process's part, compiled here unless cached: what no group takes. On two CPUs
    # requests.bpf.c (the halves' balance) and the uprobes; on more, the uprobes
    left = {by_macro[m].program if by_macro[m].kind != "uprobe" else "uprobe" for p in here for m in p.macros}
    assert left == {1: {"requests.bpf.c", "uprobe"}, 2: {"uprobe"}, 4: {"uprobe"}, 6: {"uprobe"}}[workers]
    assert len(here) == 1


def test_six_workers_split_the_default_probes_thus(monkeypatch):
    """The level-6 partition written out, so that a mistake in the first-group rule shows: the marker
    alone, requests.bpf.c's wakeup with reclaim, http.bpf.c in two, cuda's and health's tracepoints,
    and the uprobes over three parts (here three of them), each part 0.69-0.76 s serially."""
    monkeypatch.delenv(loader.SPLIT_ENV, raising=False)
    monkeypatch.setattr(loader, "memcg_headroom", lambda: None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    plan = _plan()
    name = {s.macro: s.name for s in plan.enabled()}
    got = [sorted(name[m] for m in p.macros) for p in loader.split_for(plan)[0]]
    reclaim = [s.name for s in probes.PROBES if s.program == "reclaim.bpf.c"]
    health = [s.name for s in plan.enabled() if s.program == "health.bpf.c"]
    http_in = ["http_close", "http_read", "http_read_ret", "http_recvfrom", "http_recvfrom_ret"]
    assert got == [
        ["marker"],
        sorted(reclaim + ["sched_wakeup", "cuda_sync"]),
        sorted(s.name for s in plan.enabled() if s.program == "requests.bpf.c"
               and s.name not in ("marker", "sched_wakeup")),
        http_in,
        sorted(s.name for s in probes.PROBES if s.program == "http.bpf.c" and s.name not in http_in),
        sorted(["nvidia_ioctl", "cuda_thread_exit", "cuda_alloc", "cuda_free"] + health),
        sorted(["cuda_launch", "cuda_graph", "cuda_ctx"]),
    ]
    assert [p.here for p in loader.split_for(plan)[0]] == [False] * 6 + [True]


class _FakeWorker:
    made: list = []

    def __init__(self):
        self.sent, self.stopped = None, 0
        _FakeWorker.made.append(self)

    def send(self, text, flags):
        self.sent = flags

    def stop(self):
        self.stopped += 1


def test_no_worker_outlives_a_begin_or_a_compile_ahead_that_fails(monkeypatch):
    """_begin runs on the main thread (compile_ahead): ^C in a cache look-up stops the workers begun
    and sent; a compile thread that cannot start (TasksMax) leaves none running and no compile ahead."""
    import threading

    monkeypatch.setattr(loader, "_Worker", _FakeWorker)
    _FakeWorker.made = []
    parts = (loader.Part(("MCP_PROBE_A",), ()), loader.Part(("MCP_PROBE_B",), ()))
    spawned = [_FakeWorker(), _FakeWorker()]
    monkeypatch.setenv(compile_cache.ENV, "/nonexistent-cache")

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(compile_cache, "key", interrupted)
    with pytest.raises(KeyboardInterrupt):
        loader._begin("text", ["-DMCP_PROBE_A=1", "-DMCP_PROBE_B=1"], (parts, ""), spawned)
    assert [w.stopped > 0 for w in _FakeWorker.made] == [True, True]

    monkeypatch.setenv(compile_cache.ENV, "off")
    _FakeWorker.made = []
    monkeypatch.setattr(loader, "_check_header_tree", lambda: None)
    monkeypatch.setattr(loader, "split_for", lambda plan, budget=None: (parts, ""))
    monkeypatch.setattr(loader, "_bpf_class", lambda: None)

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    loader.compile_ahead(_plan(), {})
    assert loader._ahead is None
    assert len(_FakeWorker.made) == 2 and all(w.sent and w.stopped for w in _FakeWorker.made)


def test_workers_begun_early_and_not_sent_a_part_are_stopped(monkeypatch):
    """begin_early's workers belong to the compile_ahead that follows: one that compiles nothing (no
    probe enabled, no header tree, no kernel set-up) stops them; one whose cache is warm stops them
    and starts none; one short of workers starts the rest."""
    from mcp_hostagent.core import kernel

    monkeypatch.setattr(loader, "_Worker", _FakeWorker)
    monkeypatch.setenv(compile_cache.ENV, "off")
    parts = (loader.Part(("MCP_PROBE_A",), ()), loader.Part(("MCP_PROBE_B",), ()), loader.Part(("MCP_PROBE_C",), ()))
    monkeypatch.setattr(loader, "split_for", lambda plan, budget=None: (parts, ""))

    def early(n):
        _FakeWorker.made = []
        loader._early[:] = [_FakeWorker() for _ in range(n)]
        return list(_FakeWorker.made)

    nothing = probes.plan([s.name for s in probes.PROBES], exists=lambda cat, ev: True)
    assert not nothing.enabled()
    begun = early(2)
    loader.compile_ahead(nothing, {})
    assert all(w.stopped for w in begun) and not loader._early

    def no_tree():
        raise loader.LoadError("no tree")

    monkeypatch.setattr(loader, "_check_header_tree", no_tree)
    begun = early(2)
    loader.compile_ahead(_plan(), {})
    assert all(w.stopped for w in begun) and not loader._early

    def no_kernel(*a, **k):
        raise kernel.KernelSetupError("no tracefs")

    monkeypatch.setattr(kernel, "prepare", no_kernel)
    begun = early(2)
    loader.compile_ahead_for(type("Cfg", (), {"kernel_headers": None, "kernel_link_modules_build": False})())
    assert all(w.stopped for w in begun) and not loader._early

    monkeypatch.setattr(loader, "_check_header_tree", lambda: None)
    monkeypatch.setattr(loader, "_bpf_class", lambda: None)
    monkeypatch.setattr(loader, "_warm", lambda text, cflags, split: ("h", True))
    begun = early(2)
    loader.compile_ahead(_plan(), {})
    loader.drop_ahead()
    assert all(w.stopped and w.sent is None for w in begun)  # warm: parts go to workers _begin starts

    monkeypatch.setattr(loader, "_warm", lambda text, cflags, split: ("h", False))
    begun = early(2)
    loader.compile_ahead(_plan(), {})
    loader.drop_ahead()
    assert len(_FakeWorker.made) == 3 and all(w.sent for w in _FakeWorker.made)  # two begun early, one more now


def test_the_split_is_the_count_begin_early_made_before_its_workers_were_charged(monkeypatch):
    """Six early workers take ~300 MiB of a memory cgroup's room: counted again after them, the room
    would allow none, and the start would compile in one process (its parts cached under another split
    than the next start's). compile_ahead splits by begin_early's count and sends all six a part."""
    monkeypatch.setattr(loader, "_Worker", _FakeWorker)
    monkeypatch.setattr(loader, "_preload_libbcc", lambda: None)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv(compile_cache.ENV, "off")
    monkeypatch.delenv(loader.SPLIT_ENV, raising=False)
    _FakeWorker.made = []
    room = loader.START_MEMORY + 6 * loader.WORKER_MEMORY
    monkeypatch.setattr(loader, "memcg_headroom",
                        lambda: room - sum(not w.stopped for w in _FakeWorker.made) * loader.WORKER_MEMORY)
    loader.begin_early()
    assert len(_FakeWorker.made) == 6
    assert [p.here for p in loader.split_for(_plan())[0]] == [True]  # counted now: no room for a worker
    monkeypatch.setattr(loader, "_check_header_tree", lambda: None)
    monkeypatch.setattr(loader, "_bpf_class", lambda: None)
    loader.compile_ahead(_plan(), {})
    loader.drop_ahead()
    assert len(_FakeWorker.made) == 6 and all(w.sent for w in _FakeWorker.made)
    assert loader._take_early() == ([], None)


def test_the_entry_begins_early_only_for_a_run_that_compiles(monkeypatch):
    from mcp_hostagent import cli, entry

    calls = []
    monkeypatch.setattr(loader, "begin_early", lambda: calls.append("early"))
    monkeypatch.setattr(cli, "main", lambda: calls.append("cli"))
    for argv, early in ((["run"], True), (["run", "--jsonl", "none", "--duration", "1"], True),
                        (["run", "--help"], False), (["run", "-h"], False), (["run", "--show-config"], False),
                        (["probes"], False), (["top", "run"], False), ([], False)):
        calls.clear()
        monkeypatch.setattr(sys, "argv", ["mcp-agent", *argv])
        entry.main()
        assert calls == (["early", "cli"] if early else ["cli"]), argv

    def fails():
        calls.append("early")
        raise OSError("no /proc")

    monkeypatch.setattr(loader, "begin_early", fails)
    calls.clear()
    monkeypatch.setattr(sys, "argv", ["mcp-agent", "run"])
    entry.main()
    assert calls == ["early", "cli"]  # a head start that fails leaves the CLI to do it all and report


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


def test_the_groups_name_real_sources_and_probes_and_none_is_empty():
    names = {s.name for s in probes.PROBES} | {s.program for s in probes.PROBES}
    default = _plan().enabled()
    for n, groups in loader.WORKER_GROUPS.items():
        assert len(groups) == n
        for g in groups:
            assert set(g) <= names, set(g) - names
        used = {next((i for i, g in enumerate(groups) if s.name in g or (s.kind != "uprobe" and s.program in g)), None)
                for s in default}
        assert set(range(n)) <= used, (n, used)  # every group takes a default probe no earlier one took


def test_every_uprobe_program_is_known_as_kprobe_type_and_nothing_else():
    """loader.KPROBE_PROGRAM finds the programs whose context is struct pt_regs in the unit's text:
    each libcuda symbol's entry and return program (cuda/symbols.py), and no tracepoint program."""
    from mcp_hostagent.cuda.symbols import SYMBOLS

    found = loader.kprobe_programs(loader.unit_source())
    assert found == {s.entry for s in SYMBOLS} | {s.ret for s in SYMBOLS if s.ret}
    assert not found & {s.fn_name for s in _plan().enabled() if s.kind in probes.TRACEPOINT_KINDS}


def test_parts_load_side_by_side_and_what_a_part_raises_reaches_the_caller(monkeypatch):
    """_load_parts: each part's _load_all in its own thread (the verifier runs inside bpf(2), without
    the GIL), the results in the parts' order; an exception in a part's thread (a damaged cache reply's
    KeyError) is raised in the caller's, where _compile turns it into the one-process fallback."""
    import threading

    seen, gate = [], threading.Barrier(3, timeout=5)

    def load_all(bpf, funcs, kprobes, reply):
        gate.wait()  # only passes when all three parts are being loaded at once
        seen.append(threading.current_thread().name)
        if reply.get("broken"):
            raise KeyError("license")
        return reply.get("fail", "")

    monkeypatch.setattr(loader, "_load_all", load_all)
    parts = [({}, {}), ({}, {"fail": "p: EACCES"}), ({}, {})]
    assert loader._load_parts(None, parts, set()) == ["", "p: EACCES", ""]
    assert len(set(seen)) == 3
    gate.reset()
    with pytest.raises(KeyError, match="license"):
        loader._load_parts(None, [({}, {}), ({}, {}), ({}, {"broken": True})], set())


def _alone() -> str:
    """split_for's reason where the whole unit is one part compiled here (and cached)."""
    plan = _plan()
    (part,), why = loader.split_for(plan)
    assert part.here and sorted(part.macros) == sorted(s.macro for s in plan.enabled()), part
    assert why.startswith("1 process (")
    return why


def test_one_process_on_one_cpu_when_asked_or_short_of_memory(monkeypatch):
    monkeypatch.setattr(loader, "memcg_headroom", lambda: 1 << 30)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert _alone() == "1 process (one CPU)"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setenv(loader.SPLIT_ENV, "0")
    assert loader.split_for(_plan()) == ((), "1 process (MCP_HOSTAGENT_COMPILE_SPLIT=0)")
    monkeypatch.delenv(loader.SPLIT_ENV)
    workers = lambda: [p for p in loader.split_for(_plan())[0] if not p.here]  # noqa: E731
    assert len(workers()) == 6
    # room for five workers, not six: the four-worker grouping; for one, not two: the two-CPU one
    monkeypatch.setattr(loader, "memcg_headroom", lambda: loader.START_MEMORY + 6 * loader.WORKER_MEMORY - 1)
    assert len(workers()) == 4
    monkeypatch.setattr(loader, "memcg_headroom", lambda: loader.START_MEMORY + 2 * loader.WORKER_MEMORY - 1)
    assert len(workers()) == 1
    monkeypatch.setattr(loader, "memcg_headroom", lambda: loader.START_MEMORY + loader.WORKER_MEMORY - 1)
    assert "memory cgroup" in _alone()


def test_a_cpu_quota_a_worker_cap_or_hidden_limits_take_fewer_workers(monkeypatch):
    monkeypatch.setattr(loader, "memcg_headroom", lambda: None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv(loader.SPLIT_ENV, raising=False)
    workers = lambda: [p for p in loader.split_for(_plan())[0] if not p.here]  # noqa: E731
    # a quota counts as its whole CPUs: 2.5 CPUs, one worker beside this process (the two-CPU grouping)
    monkeypatch.setattr(loader, "cpu_quota", lambda: 2.5)
    assert len(workers()) == 1
    monkeypatch.setattr(loader, "cpu_quota", lambda: 1.5)
    assert _alone() == "1 process (a CPU quota of 1.5 CPUs)"
    monkeypatch.setattr(loader, "cpu_quota", lambda: 0.2)
    assert _alone() == "1 process (a CPU quota of 0.2 CPUs)"
    monkeypatch.setattr(loader, "cpu_quota", lambda: 64.0)  # above the CPUs it may run on: those count
    assert len(workers()) == 6
    # limits it cannot read: one process unless told how many workers
    monkeypatch.setattr(loader, "limits_hidden", lambda: True)
    why = _alone()
    assert "hidden" in why and loader.SPLIT_ENV + "=N" in why
    for n, expect in (("2", 2), ("4", 4), ("9", 6), ("1", 1)):
        monkeypatch.setenv(loader.SPLIT_ENV, n)
        assert len(workers()) == expect, n
    monkeypatch.setattr(loader, "memcg_headroom", lambda: loader.START_MEMORY + loader.WORKER_MEMORY)  # still counts
    monkeypatch.setenv(loader.SPLIT_ENV, "4")
    assert len(workers()) == 1
    monkeypatch.setenv(loader.SPLIT_ENV, "00")
    assert loader.split_for(_plan()) == ((), "1 process (MCP_HOSTAGENT_COMPILE_SPLIT=0)")  # the cache off too
    for bad in ("two", "-1", "\u00b2", "\u0663"):  # superscript two and Arabic-Indic three: isdigit(), not int()
        monkeypatch.setenv(loader.SPLIT_ENV, bad)
        assert _alone() == f"1 process (MCP_HOSTAGENT_COMPILE_SPLIT={bad!r} is not a number of workers)"


def test_cpu_quota_is_the_lowest_on_the_way_up_v2_and_v1(tmp_path):
    root = tmp_path / "cg"
    _cg(root, "", **{"cgroup.controllers": "cpu memory"})
    _cg(root, "kubepods.slice", cpu_max="max 100000")
    _cg(root, "kubepods.slice/pod1", cpu_max="300000 100000")
    _cg(root, "kubepods.slice/pod1/ctr", cpu_max="max 100000")
    (tmp_path / "cgroup").write_text("0::/kubepods.slice/pod1/ctr\n")
    assert CPU_QUOTA(str(tmp_path / "cgroup"), str(root)) == 3.0
    _cg(root, "kubepods.slice/pod1/ctr", cpu_max="50000 100000")
    assert CPU_QUOTA(str(tmp_path / "cgroup"), str(root)) == 0.5
    (tmp_path / "cgroup").write_text("0::/kubepods.slice\n")
    assert CPU_QUOTA(str(tmp_path / "cgroup"), str(root)) is None
    # v1, with systemd's cpu -> cpu,cpuacct link and without it
    v1 = tmp_path / "v1"
    _cg(v1, "cpu,cpuacct/box", cpu_cfs_quota_us=150000, cpu_cfs_period_us=100000)
    _cg(v1, "cpu,cpuacct", cpu_cfs_quota_us=-1, cpu_cfs_period_us=100000)
    (tmp_path / "cgroup").write_text("3:cpu,cpuacct:/box\n0::/\n")
    assert CPU_QUOTA(str(tmp_path / "cgroup"), str(v1)) == 1.5
    (v1 / "cpu").symlink_to(v1 / "cpu,cpuacct")
    assert CPU_QUOTA(str(tmp_path / "cgroup"), str(v1)) == 1.5
    (tmp_path / "cgroup").write_text("3:cpu,cpuacct:/\n")
    assert CPU_QUOTA(str(tmp_path / "cgroup"), str(v1)) is None
    assert CPU_QUOTA(str(tmp_path / "nothing"), str(v1)) is None


def test_limits_are_hidden_where_a_cgroup_mount_shows_a_root_above_the_namespace(tmp_path):
    """mountinfo's fourth field (the mount's root, relative to the reader's cgroup namespace): "/.."
    and below for a hierarchy mounted from above the namespace, as the DaemonSet's node mount is."""
    mi = tmp_path / "mountinfo"
    head = "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"

    def hidden(*lines: str) -> bool:
        mi.write_text(head + "".join(lines))
        return LIMITS_HIDDEN(str(mi), "/sys/fs/cgroup")

    v2 = "29 23 0:26 {root} /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
    assert hidden(v2.format(root="/../../.."))
    assert hidden(v2.format(root="/.."))
    assert not hidden(v2.format(root="/"))  # the namespace's own mount, or no namespace
    assert not hidden(v2.format(root="/..x"))  # a cgroup named "..x", not a parent
    memory = "35 31 0:32 {root} /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    cpu = "32 31 0:29 {root} /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
    pids = "39 31 0:36 {root} /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids\n"
    assert hidden(memory.format(root="/../.."))
    assert hidden(cpu.format(root="/.."))
    assert not hidden(pids.format(root="/../.."))  # a hierarchy this does not read
    assert not hidden(memory.format(root="/docker/abc"))  # v1 docker: its own cgroup bound there
    assert not hidden(v2.format(root="/..").replace("/sys/fs/cgroup", "/host/sys/fs/cgroup"))  # not under root
    assert not LIMITS_HIDDEN(str(tmp_path / "unreadable"))


def test_limits_are_hidden_in_a_real_cgroup_namespace_below_the_mount():
    """This kernel's own mountinfo: a child that joins a fresh cgroup, then enters a cgroup namespace
    of its own (unshare --cgroup, util-linux) with the host's /sys/fs/cgroup still mounted, is told
    its limits are hidden and compiles in one process; the same child without the namespace is not,
    nor is this test's process."""
    import shutil
    import subprocess

    assert not LIMITS_HIDDEN(), "this runner's own cgroup limits read as hidden"
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.fail("unshare (util-linux) is not installed")
    name = f"mcp-hidden-{os.getpid()}"
    v1 = "/sys/fs/cgroup/memory"
    if os.path.isdir(v1):
        path = os.path.join(v1, name)
    else:
        from mcp_hostagent.requests.owners import cgroup2_root

        root = cgroup2_root()
        if root is None:
            pytest.fail("no cgroup hierarchy with a memory controller or v2 on this host")
        path = os.path.join(root, name)
    probe = ("import os, sys; from mcp_hostagent.core import loader, probes;"
             "os.sched_getaffinity = lambda pid: set(range(8)); loader.cpu_quota = lambda: None;"
             "print(loader.limits_hidden());"
             "print(loader.split_for(probes.plan((), exists=lambda c, e: True))[1] or 'split')")
    env = {k: v for k, v in os.environ.items() if k != loader.SPLIT_ENV}
    os.mkdir(path)
    try:
        # the shell joins the cgroup, then execs into the namespace: its root is that cgroup
        run = lambda *ns: subprocess.run(  # noqa: E731
            ["sh", "-c", f'echo $$ > {path}/cgroup.procs && exec "$@"', "sh", *ns, sys.executable, "-c", probe],
            env=env, capture_output=True, text=True, check=True).stdout.split("\n")
        inside = run(unshare, "--cgroup")
        assert inside[0] == "True" and "hidden" in inside[1], inside
        outside = run()
        assert outside[0] == "False" and outside[1] == "split", outside
    finally:
        _rmdir_when_empty(path)


def test_a_real_cpu_quota_decides_the_split():
    """This kernel's own files: a child process in a fresh cpu cgroup with a quota of one CPU is told
    one process, with the quota; its parent (no quota) is not."""
    import subprocess

    name = f"mcp-quota-{os.getpid()}"
    probe = ("import os; from mcp_hostagent.core import loader, probes;"
             "os.sched_getaffinity = lambda pid: set(range(8));"
             "loader.memcg_headroom = lambda: None; loader.limits_hidden = lambda: False;"
             "print(loader.split_for(probes.plan((), exists=lambda c, e: True))[1] or 'split');"
             "print(loader.cpu_quota())")
    v1 = "/sys/fs/cgroup/cpu"
    if os.path.isdir(v1) and os.path.exists(os.path.join(v1, "cpu.cfs_quota_us")):
        path = os.path.join(v1, name)
        quota = lambda q: [open(os.path.join(path, "cpu.cfs_period_us"), "w").write("100000"),  # noqa: E731
                           open(os.path.join(path, "cpu.cfs_quota_us"), "w").write(str(q))]
    else:
        from mcp_hostagent.requests.owners import cgroup2_root

        root = cgroup2_root()
        if root is None or "cpu" not in open(os.path.join(root, "cgroup.controllers")).read().split():
            pytest.fail("no cgroup cpu controller (neither v1 nor v2) on this host")
        open(os.path.join(root, "cgroup.subtree_control"), "w").write("+cpu")
        path = os.path.join(root, name)
        quota = lambda q: open(os.path.join(path, "cpu.max"), "w").write(f"{q} 100000")  # noqa: E731
    env = {k: v for k, v in os.environ.items() if k != loader.SPLIT_ENV}
    join = f"open({os.path.join(path, 'cgroup.procs')!r}, 'w').write(str(os.getpid()));"
    os.mkdir(path)
    try:
        quota(100000)
        one = subprocess.run([sys.executable, "-c", "import os;" + join + probe], env=env,
                             capture_output=True, text=True, check=True).stdout.split("\n")
        assert one[:2] == ["1 process (a CPU quota of 1 CPUs)", "1.0"], one
        quota(350000)
        more = subprocess.run([sys.executable, "-c", "import os;" + join + probe], env=env,
                              capture_output=True, text=True, check=True).stdout.split("\n")
        assert more[:2] == ["split", "3.5"], more
    finally:
        _rmdir_when_empty(path)


def _rmdir_when_empty(path: str) -> None:
    """A test cgroup, once its last process has gone (the kernel empties it a moment after the exit)."""
    for _ in range(50):
        try:
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.1)


def _cg(root, rel: str, **files) -> None:
    d = root.joinpath(*rel.strip("/").split("/")) if rel.strip("/") else root
    d.mkdir(parents=True, exist_ok=True)
    for name, v in files.items():
        (d / name.replace("_", ".", 1)).write_text(f"{v}\n")


def test_headroom_is_the_lowest_limit_on_the_way_up_v2(tmp_path):
    """memory.high counts as a limit (the kernel throttles above it); an unlimited level ("max") none."""
    root = tmp_path / "cg"
    _cg(root, "", **{"cgroup.controllers": "cpu memory"})
    _cg(root, "system.slice", memory_max="max", memory_high="max", memory_current=900 << 20)
    _cg(root, "system.slice/mcp-agent.service", memory_max=256 << 20, memory_high=200 << 20,
        memory_current=90 << 20)
    (tmp_path / "cgroup").write_text("0::/system.slice/mcp-agent.service\n")
    assert loader.memcg_headroom(str(tmp_path / "cgroup"), str(root)) == 110 << 20
    # a slice limited closer to its use than the unit is
    _cg(root, "system.slice", memory_max=1000 << 20)
    assert loader.memcg_headroom(str(tmp_path / "cgroup"), str(root)) == 100 << 20
    (tmp_path / "cgroup").write_text("0::/\n")
    assert loader.memcg_headroom(str(tmp_path / "cgroup"), str(root)) is None


def test_headroom_v1_and_unreadable(tmp_path):
    root = tmp_path / "cg"
    _cg(root, "memory/box", memory_limit_in_bytes=256 << 20, memory_usage_in_bytes=250 << 20)
    (tmp_path / "cgroup").write_text("4:memory:/box\n0::/\n")
    assert loader.memcg_headroom(str(tmp_path / "cgroup"), str(root)) == 6 << 20
    (tmp_path / "cgroup").write_text("4:memory:/elsewhere\n")
    assert loader.memcg_headroom(str(tmp_path / "cgroup"), str(root)) is None
    assert loader.memcg_headroom(str(tmp_path / "nothing"), str(root)) is None


def test_headroom_of_a_real_memory_cgroup_decides_the_split(tmp_path):
    """This kernel's own files: a child process in a fresh memory cgroup limited to just above its
    use is told one process; the same child outside it, with room, two (tests/reclaim's memcg)."""
    import subprocess

    name = f"mcp-split-{os.getpid()}"
    v1 = "/sys/fs/cgroup/memory"
    probe = ("import os, sys; from mcp_hostagent.core import loader; from mcp_hostagent.core import probes;"
             "os.sched_getaffinity = lambda pid: {0, 1};"
             "print(loader.split_for(probes.plan((), exists=lambda c, e: True))[1] or 'split');"
             "print(loader.memcg_headroom())")
    if os.path.isdir(v1):
        path, limit, usage = os.path.join(v1, name), "memory.limit_in_bytes", "memory.usage_in_bytes"
    else:
        from mcp_hostagent.requests.owners import cgroup2_root

        root = cgroup2_root()
        if root is None or "memory" not in open(os.path.join(root, "cgroup.controllers")).read().split():
            pytest.fail("no cgroup memory controller (neither v1 nor v2) on this host")
        open(os.path.join(root, "cgroup.subtree_control"), "w").write("+memory")
        path, limit, usage = os.path.join(root, name), "memory.max", "memory.current"
    os.mkdir(path)
    try:
        open(os.path.join(path, limit), "w").write(str(1 << 40))
        env = dict(os.environ, MCP_HOSTAGENT_COMPILE_SPLIT="1")  # at most one worker, no hidden-limits check
        # the child joins the cgroup before it imports anything: its interpreter's charge is counted
        join = f"open({os.path.join(path, 'cgroup.procs')!r}, 'w').write(str(os.getpid()));"
        roomy = subprocess.run([sys.executable, "-c", "import os;" + join + probe], env=env,
                               capture_output=True, text=True, check=True).stdout.split("\n")
        assert roomy[0] == "split", roomy
        # now a limit 32 MiB above what an idle cgroup holds: less than the worker needs
        open(os.path.join(path, limit), "w").write(str(int(open(os.path.join(path, usage)).read()) + (32 << 20)))
        tight = subprocess.run([sys.executable, "-c", "import os;" + join + probe], env=env,
                               capture_output=True, text=True, check=True).stdout.split("\n")
        assert "memory cgroup" in tight[0] and int(tight[1]) < loader.START_MEMORY + loader.WORKER_MEMORY, tight
    finally:
        _rmdir_when_empty(path)


# ---- real compiles ----

def _load(monkeypatch, split: str, extra_cflags: tuple[str, ...] = (), cache: str = "off"):
    """split: SPLIT_ENV's value ("0" one process), "" for as many workers as the CPUs allow."""
    from mcp_hostagent.config import load_config
    from mcp_hostagent.core import kernel

    cfg = load_config(None, env={})
    kernel.prepare(cfg.kernel_headers, cfg.kernel_link_modules_build, report=False)
    if split:
        monkeypatch.setenv(loader.SPLIT_ENV, split)
    else:
        monkeypatch.delenv(loader.SPLIT_ENV, raising=False)
    monkeypatch.setenv(compile_cache.ENV, cache)
    plan = probes.plan(cfg.probes_disable, off=probes.switched_off(cfg))
    (got,) = loader.load(plan, loader.bpf_settings(cfg), extra_cflags=extra_cflags)
    return got, plan


def check_adopted(got, plan) -> None:
    """Every program a worker (or the cache) gave uses only this process's maps (the kernel's record
    of the loaded program), each worker probe's program came from there, and all of them attached."""
    from bcc import BPF

    b = got.bpf
    assert b.adopted, "no program came from a worker"
    fds = compile_worker.tables(b.module) if b.module else [fd for fd, _ in b.made.values()]  # made: core/mapset.py
    ours = {map_id(fd) for fd in fds}
    apart = [s for s in plan.enabled() if s.macro in _macros(p for p in loader.split_for(plan)[0] if not p.here)
             and s.kind in probes.TRACEPOINT_KINDS]
    assert apart and set(b.adopted) >= {s.fn_name.encode() for s in apart}
    kprobes = loader.kprobe_programs(loader.unit_source())
    for name in b.adopted:
        kind = BPF.KPROBE if name.decode() in kprobes else BPF.TRACEPOINT
        used = prog_map_ids(b.load_func(name, kind).fd)
        assert used and used <= ours, (name, used, ours)
    attached = {n for n, st in plan.statuses.items() if st.state == probes.ATTACHED}
    assert {s.name for s in apart} <= attached


def _stored(cache) -> list:
    """The cache's entries of parts and maps (not the warm hint)."""
    return [e for e in cache.glob("*.json") if e.stem != compile_cache.WARM]


def _entries(cache) -> tuple[list, list]:
    """The cache's part entries: (the workers' parts', this process's (uprobes) part's), each sorted by
    name."""
    kprobes = loader.kprobe_programs(loader.unit_source())
    entries = sorted(e for e in _stored(cache) if "funcs" in json.loads(e.read_text())["reply"])
    here = [e for e in entries if set(json.loads(e.read_text())["reply"]["funcs"]) <= kprobes]
    return [e for e in entries if e not in here], here


@pytest.mark.bpf
@pytest.mark.parametrize("cpus", [2, 3, 16])
def test_the_workers_programs_use_the_agents_maps(monkeypatch, tmp_path, cpus):
    """Also: started from a directory holding a planted worker module, the agent runs its own."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))  # on fewer CPUs too (only slower)
    monkeypatch.setattr(loader, "memcg_headroom", lambda: None)
    planted = tmp_path / "mcp_hostagent" / "core"
    planted.mkdir(parents=True)
    for d in (planted, planted.parent):
        (d / "__init__.py").write_text("")
    marker = tmp_path / "planted-ran"
    (planted / "compile_worker.py").write_text(f"open({str(marker)!r}, 'w').write('root')\n")
    monkeypatch.chdir(tmp_path)
    got, plan = _load(monkeypatch, "")
    try:
        assert not marker.exists(), "the worker ran a module from the agent's working directory"
        workers = [p for p in loader.split_for(plan)[0] if not p.here]
        assert len(workers) == {2: 1, 3: 2}.get(cpus, len(loader.WORKER_GROUPS[6]))
        assert got.processes == f"{1 + len(workers)} processes"
        check_adopted(got, plan)
    finally:
        got.bpf.cleanup()


@pytest.mark.bpf
def test_a_program_the_kernel_refused_at_the_check_is_not_loaded_again(monkeypatch):
    """_load_all checks each part's programs before the part is used or cached; a refusal is kept on
    the BPF object and the attach's load_func raises it without a second load (bcc would print its
    verifier log twice). The refusal is the kernel's: exit with r0 unset."""
    from mcp_hostagent.core import bpfsys

    cls = loader._bpf_class()
    b = cls.__new__(cls)  # no compile: only the load path is under test
    b.refused, b.funcs = {}, {}
    b.adopt({b"mcp_refused": insn(0x95)}, b"GPL", 0)
    loads = []
    real = bpfsys.prog_load
    monkeypatch.setattr(bpfsys, "prog_load", lambda *a, **k: loads.append(a) or real(*a, **k))
    why = loader._load_all(b, {b"mcp_refused": insn(0x95)}, set(), {"license": "GPL", "kern_version": 0})
    assert why.startswith("mcp_refused: ") and len(loads) == 1, (why, loads)
    with pytest.raises(Exception) as e:
        b.load_func(b"mcp_refused", cls.TRACEPOINT)
    assert str(e.value) == b.refused[b"mcp_refused"] and len(loads) == 1
    assert "EACCES" in str(e.value) or "EINVAL" in str(e.value), str(e.value)


@pytest.mark.bpf
def test_on_two_cpus_this_processs_part_is_cached_too(monkeypatch, tmp_path):
    """On two CPUs this process compiles requests.bpf.c's probes beside the one worker: they are in its
    part with the uprobes, cached too, so that a cached start compiles the maps alone and adopts every
    program (on this process's maps, the probes attached as in one process)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(loader, "memcg_headroom", lambda: None)
    cache = tmp_path / "cache"
    got, plan = _load(monkeypatch, "", cache=str(cache))
    got.bpf.cleanup()
    assert got.processes == "2 processes", got.processes
    mine = {s.fn_name for s in plan.enabled() if s.program == "requests.bpf.c" and s.kind in probes.TRACEPOINT_KINDS}
    kprobes = loader.kprobe_programs(loader.unit_source())
    theirs, here = _entries(cache)
    parts = [set(json.loads(e.read_text())["reply"]["funcs"]) for e in theirs + here]
    assert mine and len(parts) == 2 and mine | kprobes in parts, parts

    got, plan = _load(monkeypatch, "", cache=str(cache))
    try:
        assert got.processes == "1 process, 2 parts and the maps from the compile cache", got.processes
        check_adopted(got, plan)
        assert {n.decode() for n in got.bpf.adopted} >= mine | kprobes
        assert not any(loader._compiled_here(got.bpf, n.encode()) for n in mine | kprobes)
        single, plan1 = _load(monkeypatch, "0")
        single.bpf.cleanup()
        assert {n: st.state for n, st in plan.statuses.items()} == {n: st.state for n, st in plan1.statuses.items()}
    finally:
        got.bpf.cleanup()


@pytest.mark.bpf
def test_without_a_worker_the_unit_is_still_cached(monkeypatch, tmp_path):
    """One CPU, a CPU quota under two or hidden limits start no worker, but the whole unit is one
    part compiled here and cached: the next start compiles nothing. Asked for one process
    (MCP_HOSTAGENT_COMPILE_SPLIT=0), the cache is neither read nor written."""
    from bcc import libbcc

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(loader, "cpu_quota", lambda: 1.0)
    from bcc import BPF

    other = tmp_path / "other"
    single, plan1 = _load(monkeypatch, "0", cache=str(other))
    mod = single.bpf.module
    every = {libbcc.lib.bpf_function_name(mod, i).decode() for i in range(libbcc.lib.bpf_num_functions(mod))}
    single.bpf.cleanup()
    assert single.processes == "1 process (MCP_HOSTAGENT_COMPILE_SPLIT=0)" and not other.exists()

    cache = tmp_path / "cache"
    got, plan = _load(monkeypatch, "", cache=str(cache))
    got.bpf.cleanup()
    assert got.processes == "1 process (a CPU quota of 1 CPUs)", got.processes
    (entry,) = [e for e in _stored(cache) if "funcs" in json.loads(e.read_text())["reply"]]
    assert set(json.loads(entry.read_text())["reply"]["funcs"]) == every

    got, plan = _load(monkeypatch, "", cache=str(cache))
    try:
        assert got.processes == "1 process (a CPU quota of 1 CPUs), 1 part and the maps from the compile cache"
        assert got.bpf.module is None
        assert {n.decode() for n in got.bpf.adopted} == every
        ours = {map_id(fd) for fd, _ in got.bpf.made.values()}  # made: core/mapset.py
        kprobes = loader.kprobe_programs(loader.unit_source())
        for name in got.bpf.adopted:
            used = prog_map_ids(got.bpf.load_func(name, BPF.KPROBE if name.decode() in kprobes else BPF.TRACEPOINT).fd)
            assert used and used <= ours, (name, used, ours)
        assert {n: st.state for n, st in plan.statuses.items()} == {n: st.state for n, st in plan1.statuses.items()}
    finally:
        got.bpf.cleanup()


@pytest.mark.bpf
def test_with_six_workers_this_process_compiles_the_maps_and_three_uprobes_and_a_cached_start_nothing(monkeypatch, tmp_path):
    """On many CPUs six workers take every tracepoint probe and three of the uprobes, and this
    process's own compile holds the other three uprobes alone; the six parts, this process's and the maps are cached, and a cached start makes
    the maps and adopts every program, with the probes' states those of a one-process compile."""
    from bcc import libbcc

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(loader, "memcg_headroom", lambda: None)
    cache = tmp_path / "cache"
    got, plan = _load(monkeypatch, "", cache=str(cache))
    n = len(loader.split_for(plan)[0])  # 7 where every default probe's hook exists: six workers' and here
    kprobes = loader.kprobe_programs(loader.unit_source())
    try:
        assert n >= 5 and [p.here for p in loader.split_for(plan)[0]] == [False] * (n - 1) + [True]
        assert got.processes == f"{n} processes", got.processes
        mod = got.bpf.module
        here = {libbcc.lib.bpf_function_name(mod, i).decode() for i in range(libbcc.lib.bpf_num_functions(mod))}
        # uprobe programs only, three of the six probes': the others come from two workers
        assert here and here < kprobes, (here, kprobes)
        assert all(loader._compiled_here(got.bpf, k.encode()) for k in here)
        assert not any(loader._compiled_here(got.bpf, k.encode()) for k in kprobes - here)
        (mine,) = [p for p in loader.split_for(plan)[0] if p.here]
        assert sorted(s.name for s in plan.enabled() if s.macro in mine.macros) == ["cuda_ctx", "cuda_graph", "cuda_launch"]
        check_adopted(got, plan)
    finally:
        got.bpf.cleanup()
    entries = [json.loads(e.read_text())["reply"] for e in _stored(cache)]
    parts = [set(r["funcs"]) for r in entries if "funcs" in r]
    assert len(parts) == n and len(entries) == n + 1 and set().union(*parts) >= kprobes
    assert sum(len(p) for p in parts) == len(set().union(*parts))  # no program in two parts

    got, plan = _load(monkeypatch, "", cache=str(cache))
    try:
        assert got.processes == f"1 process, {n} parts and the maps from the compile cache", got.processes
        assert got.bpf.module is None
        check_adopted(got, plan)
        assert {n.decode() for n in got.bpf.adopted} == set().union(*parts)
        single, plan1 = _load(monkeypatch, "0")
        single.bpf.cleanup()
        assert {n: st.state for n, st in plan.statuses.items()} == {n: st.state for n, st in plan1.statuses.items()}
    finally:
        got.bpf.cleanup()


@pytest.mark.bpf
def test_the_compile_cache_replaces_the_workers_and_refuses_what_it_cannot_trust(monkeypatch, tmp_path):
    """A second start loads every part from the cache (this process compiles only the maps) and gets
    the same programs on its own maps, the uprobe programs too; a damaged entry is a miss; an entry
    whose program no longer fits (a map it names is gone, or the verifier refuses it) makes one full
    compile here and is dropped; a directory others can write is not used at all."""
    from mcp_hostagent.core.compile_worker import reply_of

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    cache = tmp_path / "cache"
    got, plan = _load(monkeypatch, "", cache=str(cache))
    kprobes = loader.kprobe_programs(loader.unit_source())
    compiled_uprobes = reply_of(got.bpf.module, kprobes)["funcs"]
    got.bpf.cleanup()
    assert got.processes == "3 processes"
    theirs, here = _entries(cache)
    maps = [e for e in _stored(cache) if e not in theirs + here]
    assert len(theirs) == 2 and len(here) == 1 and len(maps) == 1 and oct(cache.stat().st_mode & 0o777) == "0o700"
    assert all(oct(e.stat().st_mode & 0o777) == "0o600" for e in theirs + here + maps)
    assert set(json.loads(here[0].read_text())["reply"]["funcs"]) == set(compiled_uprobes) == kprobes

    got, plan = _load(monkeypatch, "", cache=str(cache))
    try:
        assert got.processes == "1 process, 3 parts and the maps from the compile cache", got.processes
        check_adopted(got, plan)
        assert {n.decode() for n in got.bpf.adopted} >= kprobes
        assert not any(loader._compiled_here(got.bpf, n.encode()) for n in kprobes)
        single, plan1 = _load(monkeypatch, "0")
        single.bpf.cleanup()
        assert {n: st.state for n, st in plan.statuses.items()} == {n: st.state for n, st in plan1.statuses.items()}
    finally:
        got.bpf.cleanup()

    # damaged: compiled again (by a worker, or here for the uprobes), and written again
    for entry, how in ((theirs[0], "2 processes, 2 parts from the compile cache"),
                       (here[0], "1 process, 2 parts from the compile cache")):
        entry.write_text("{not json")
        got, _ = _load(monkeypatch, "", cache=str(cache))
        got.bpf.cleanup()
        assert got.processes == how, got.processes
        assert json.loads(entry.read_text())["key"] == entry.stem

    entry = json.loads(theirs[1].read_text())
    entry["reply"]["maps"] = {fd: "no_such_table" for fd in entry["reply"]["maps"]}
    theirs[1].write_text(json.dumps(entry))
    assert compile_cache.warm(str(cache), compile_cache.get(str(cache), compile_cache.WARM)["hint"])
    got, _ = _load(monkeypatch, "", cache=str(cache))
    got.bpf.cleanup()
    assert got.processes.startswith("1 process (a part from a worker or the cache: "), got.processes
    assert "no_such_table" in got.processes and not theirs[1].exists()
    assert compile_cache.get(str(cache), compile_cache.WARM) is None  # the next start's workers begin ahead

    # a cached program the kernel refuses (here: exit with r0 unset), a tracepoint's or a uprobe's
    # (checked as a kprobe program): dropped, all compiled here
    for pick in (lambda: _entries(cache)[0][0], lambda: _entries(cache)[1][0]):
        got, _ = _load(monkeypatch, "", cache=str(cache))  # every part cached again
        got.bpf.cleanup()
        path = pick()
        entry = json.loads(path.read_text())
        name = sorted(entry["reply"]["funcs"])[0]
        entry["reply"]["funcs"][name] = base64.b64encode(insn(0x95)).decode()
        path.write_text(json.dumps(entry))
        got, _ = _load(monkeypatch, "", cache=str(cache))
        got.bpf.cleanup()
        assert got.processes.startswith(f"1 process (a part from a worker or the cache: {name}: "), got.processes
        assert "from the compile cache)" in got.processes and not path.exists()
        assert len(_stored(cache)) == 2  # the parts the kernel still took (the maps' entry went too)

    cache.chmod(0o777)
    got, _ = _load(monkeypatch, "", cache=str(cache))
    got.bpf.cleanup()
    assert got.processes.startswith("3 processes; compile cache not used: "), got.processes
    assert "writable by no one else" in got.processes
    # ours, but under a directory others can change (not sticky): someone could swap it
    cache.chmod(0o700)
    tmp_path.chmod(0o777)
    try:
        got, _ = _load(monkeypatch, "", cache=str(cache))
        got.bpf.cleanup()
    finally:
        tmp_path.chmod(0o700)
    assert "a directory above the cache that others can change" in got.processes, got.processes


@pytest.mark.bpf
def test_a_warm_cache_starts_no_worker_ahead_and_a_cold_one_does(monkeypatch, tmp_path):
    """A start that left every part and the maps in the cache stores its hint; compile_ahead for the
    same unit, flags and split then starts no worker before its look-ups and the start is all cached;
    a part gone since is compiled by a worker started then; without the hint, workers start ahead
    (and stop, their parts cached) and the hint is stored again."""
    from mcp_hostagent.config import load_config

    made = []

    class Counted(loader._Worker):
        def __init__(self):
            made.append(self)
            super().__init__()

    def ahead_then_load():
        cfg = load_config(None, env={})
        plan = probes.plan(cfg.probes_disable, off=probes.switched_off(cfg))
        made.clear()
        loader.compile_ahead(plan, loader.bpf_settings(cfg))
        ahead = len(made)
        (got,) = loader.load(plan, loader.bpf_settings(cfg))
        got.bpf.cleanup()
        return ahead, len(made), got.processes

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    monkeypatch.setattr(loader, "memcg_headroom", lambda: None)  # two workers whatever this runner's cgroup
    cache = tmp_path / "cache"
    got, _ = _load(monkeypatch, "", cache=str(cache))
    got.bpf.cleanup()
    assert got.processes == "3 processes"
    hint = compile_cache.get(str(cache), compile_cache.WARM)["hint"]
    monkeypatch.setattr(loader, "_Worker", Counted)
    assert ahead_then_load() == (0, 0, "1 process, 3 parts and the maps from the compile cache")
    compile_cache.put(str(cache), compile_cache.WARM, {"hint": hint})  # as stored before the early hint
    assert ahead_then_load()[:2] == (0, 0)  # warm: and it adds the early hint, for `run`'s begin_early
    assert compile_cache.warm(str(cache), compile_cache.early_hint(loader.unit_source()), "early")
    theirs, _ = _entries(cache)
    theirs[0].unlink()
    assert ahead_then_load() == (1, 1, "2 processes, 2 parts from the compile cache")  # _begin's, in compile_ahead
    (cache / f"{compile_cache.WARM}.json").unlink()
    assert ahead_then_load() == (2, 2, "1 process, 3 parts and the maps from the compile cache")
    assert all(w.proc.returncode is not None for w in made)  # started ahead, stopped: their parts were cached
    assert compile_cache.get(str(cache), compile_cache.WARM)["hint"] == hint


@pytest.mark.bpf
def test_workers_begun_before_the_config_compile_with_the_tree_their_request_names(monkeypatch, tmp_path):
    """`run` begins its workers before reading its config and before BCC_KERNEL_SOURCE is set: as
    many as split_for wants (two on three CPUs), to whom compile_ahead sends the parts, starting none
    of its own. Their environment names no usable tree: the request's does (else the worker fails and
    the start says "1 process"). That start leaves the early hint, so the next begin_early starts
    none; on another kernel it starts them again."""
    from mcp_hostagent.config import load_config
    from mcp_hostagent.core import kernel

    made = []

    class Counted(loader._Worker):
        def __init__(self):
            made.append(self)
            super().__init__()

    monkeypatch.setattr(loader, "_Worker", Counted)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    monkeypatch.setattr(loader, "memcg_headroom", lambda: None)  # two workers whatever this runner's cgroup
    monkeypatch.delenv(loader.SPLIT_ENV, raising=False)
    cache = tmp_path / "cache"
    monkeypatch.setenv(compile_cache.ENV, str(cache))
    cfg = load_config(None, env={})
    tree = kernel.find_kernel_headers(cfg.kernel_headers, False).bcc_kernel_source or \
        f"/lib/modules/{os.uname().release}/build"
    monkeypatch.setenv("BCC_KERNEL_SOURCE", str(tmp_path / "not-a-tree"))
    loader.begin_early()
    assert len(made) == 2 and len(loader._early) == 2
    kernel.prepare(cfg.kernel_headers, cfg.kernel_link_modules_build, report=False)
    monkeypatch.setenv("BCC_KERNEL_SOURCE", tree)  # what prepare sets where the tree is not bcc's default
    plan = probes.plan(cfg.probes_disable, off=probes.switched_off(cfg))
    loader.compile_ahead(plan, loader.bpf_settings(cfg))
    (got,) = loader.load(plan, loader.bpf_settings(cfg))
    got.bpf.cleanup()
    assert got.processes == "3 processes" and len(made) == 2 and not loader._early
    check = compile_cache.get(str(cache), compile_cache.WARM)
    assert check["early"] == compile_cache.early_hint(loader.unit_source())

    made.clear()
    loader.begin_early()
    assert made == [] and loader._take_early() == ([], (2, ""))
    real = os.uname()
    monkeypatch.setattr(os, "uname", lambda: type(real)((*real[:2], real.release + "x", *real[3:])))
    loader.begin_early()
    assert len(made) == 2
    loader._stop_early()
    assert all(w.proc.returncode is not None for w in made)


def test_the_warm_hint_follows_the_unit_flags_split_and_kernel(monkeypatch, tmp_path):
    h = compile_cache.hint("text", ["-DA=1"], [("MCP_PROBE_A",)])
    assert h == compile_cache.hint("text", ["-DA=1"], [("MCP_PROBE_A",)])
    assert len({h, compile_cache.hint("text2", ["-DA=1"], [("MCP_PROBE_A",)]),
                compile_cache.hint("text", ["-DA=2"], [("MCP_PROBE_A",)]),
                compile_cache.hint("text", ["-DA=1"], [("MCP_PROBE_A",), ("MCP_PROBE_B",)])}) == 4
    real = os.uname()
    monkeypatch.setattr(os, "uname", lambda: type(real)((*real[:2], real.release + "x", *real[3:])))
    assert compile_cache.hint("text", ["-DA=1"], [("MCP_PROBE_A",)]) != h
    monkeypatch.undo()
    cache = str(tmp_path / "c")
    assert not compile_cache.warm(cache, h)  # no directory
    compile_cache.mark_warm(cache, h)
    assert compile_cache.warm(cache, h) and not compile_cache.warm(cache, "other")
    os.chmod(cache, 0o777)  # a directory others can write: not trusted, not warm, no exception
    assert not compile_cache.warm(cache, h)


@pytest.mark.bpf
def test_a_maps_entry_the_cache_cannot_trust_leaves_the_maps_compiled(monkeypatch, tmp_path):
    """The maps' description is read under the cache's checks like a part: an entry that is a symlink
    is refused with the reason in the start's line, the maps are compiled, and the start goes on."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    cache = tmp_path / "cache"
    got, _ = _load(monkeypatch, "", cache=str(cache))
    got.bpf.cleanup()
    theirs, here = _entries(cache)
    (maps,) = [e for e in _stored(cache) if e not in theirs + here]
    maps.unlink()
    maps.symlink_to(theirs[0])
    got, plan = _load(monkeypatch, "", cache=str(cache))
    try:
        assert got.processes.startswith("1 process, 3 parts from the compile cache; compile cache not used: "), \
            got.processes
        assert got.bpf.module is not None and "symbolic links" in got.processes, got.processes  # O_NOFOLLOW: ELOOP
        check_adopted(got, plan)
    finally:
        got.bpf.cleanup()


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


@pytest.mark.bpf
def test_a_failing_worker_leaves_one_process_compiling_everything(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the worker exits 1 at once
    got, plan = _load(monkeypatch, "")
    try:
        assert got.processes.startswith("1 process (a part from a worker or the cache: exit 1"), got.processes
        assert not got.bpf.adopted
        single, plan1 = _load(monkeypatch, "0")
        single.bpf.cleanup()
        assert {n: s.state for n, s in plan.statuses.items()} == {n: s.state for n, s in plan1.statuses.items()}
    finally:
        got.bpf.cleanup()


@pytest.mark.bpf
def test_a_worker_that_warns_a_lot_and_is_sent_sigterm_still_replies(monkeypatch, tmp_path):
    """The worker's stderr is a file: 1 MiB of warnings (a compile against mismatched headers) does not
    wait for the agent's own compile to end, as it would in a pipe. The stop signals are the agent's:
    a SIGTERM to the worker (systemd signals the unit's whole cgroup) leaves its reply coming. And a
    program both compile (the test-only capture -DMCP_TEST_TP_RAW_EXEC adds, no probe macro guarding
    it) is this process's own, not a reason to fall back."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    stamp, pidfile = tmp_path / "flooded", tmp_path / "pid"
    wrapper = tmp_path / "python"
    wrapper.write_text(f"""#!{sys.executable}
import os, sys, time
open({str(pidfile)!r}, "w").write(str(os.getpid()))
os.write(2, b"warning: from a header\\n" * 50000)
open({str(stamp)!r}, "w").write(repr(time.monotonic()))
os.execv({sys.executable!r}, [{sys.executable!r}] + sys.argv[1:])
""")
    wrapper.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(wrapper))
    real, ends = loader._compile_quietly, []

    def ours(*a, **kw):
        got = real(*a, **kw)
        ends.append(time.monotonic())
        if len(ends) == 1:  # this process's half is done; the worker is compiling its own
            os.kill(int(pidfile.read_text()), signal.SIGTERM)
        return got

    monkeypatch.setattr(loader, "_compile_quietly", ours)
    got, _ = _load(monkeypatch, "", extra_cflags=("-DMCP_TEST_TP_RAW_EXEC=1",))
    try:
        assert got.processes == "2 processes", got.processes
        assert len(ends) == 1
        assert float(stamp.read_text()) < ends[0], "the worker's warnings waited for the agent's compile"
        from bcc import libbcc

        both = b"tp_raw__sched__sched_process_exec"
        assert both not in got.bpf.adopted and libbcc.lib.bpf_function_start(got.bpf.module, both)
    finally:
        got.bpf.cleanup()


def test_no_two_probes_the_loader_attaches_share_a_tracepoint():
    """bcc keeps one perf-event fd per tracepoint name (BPF.tracepoint_fds): a second program attached
    to the same tracepoint overwrites the first's fd, which then is never detached and stays attached
    for the life of the process (an in-process agent started 64 times filled sched_process_exit's
    64 program slots: E2BIG for every later attach). One program per tracepoint, doing what each needs."""
    from collections import Counter

    tps = Counter(p.tracepoint for p in probes.PROBES if p.kind in probes.TRACEPOINT_KINDS)
    assert not {tp: n for tp, n in tps.items() if n > 1}
