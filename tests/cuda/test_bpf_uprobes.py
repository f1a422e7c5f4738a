"""agent/cuda/uprobes.py on the real kernel: the uprobe_multi feature probe, counts through either mechanism on
the stand-in libcuda (tests/c/fake_libcuda.c, driven by tests/c/cuda_driver.c), the pid filter, and
detach time (the reason for multi links: perf-event uprobes wait out a grace period each)."""

from __future__ import annotations

import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_bpf_cuda import Driver, build  # noqa: F401  (build: the module-scoped fixture)

pytestmark = pytest.mark.bpf

SYMS = ("cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz",  # driver's "calls" order
        "cuGraphLaunch", "cuGraphLaunch_ptsz", "cuCtxPushCurrent", "cuCtxPushCurrent_v2",
        "cuCtxPopCurrent", "cuCtxPopCurrent_v2", "cuCtxSetCurrent", "cuStreamSynchronize",
        "cuStreamSynchronize_ptsz", "cuCtxSynchronize", "cuEventSynchronize", "cuMemAlloc_v2",
        "cuMemAllocAsync", "cuMemAllocAsync_ptsz", "cuMemFree_v2", "cuCtxSynchronize_v2", "cuMemFreeAsync",
        "cuMemFreeAsync_ptsz")

RET_SYMS = [s for s in SYMS if s.startswith(("cuCtx", "cuStream", "cuEvent", "cuMem"))]
PROGS = "BPF_ARRAY(hits, u64, 64);\n" + "\n".join(
    f"int p{i}(struct pt_regs *ctx) {{ int k = {i}; u64 *v = hits.lookup(&k); if (v) __sync_fetch_and_add(v, 1); "
    f"return 0; }}" for i in range(64))


def kernel_at_least(major: int, minor: int) -> bool:
    m = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return (int(m.group(1)), int(m.group(2))) >= (major, minor)


def prog_ids(b) -> set[int]:
    """The kernel ids of the programs a bcc object loaded (/proc/self/fdinfo of each program fd)."""
    out = set()
    for fn in b.funcs.values():
        m = re.search(r"^prog_id:\s+(\d+)$", open(f"/proc/self/fdinfo/{fn.fd}").read(), re.M)
        if m:
            out.add(int(m.group(1)))
    return out


def uprobe_links(pids=None) -> list[dict]:
    """The uprobe_multi links `pids` hold (default: every process), from /proc/PID/fdinfo (Linux 6.10+
    prints a uprobe_multi link's prog id, path and offsets there)."""
    out = []
    for pid in pids or [int(p) for p in os.listdir("/proc") if p.isdigit()]:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:bpf_link":
                    continue
                text = open(f"/proc/{pid}/fdinfo/{fd}").read()
            except OSError:
                continue
            kind = re.search(r"^link_type:\s+(\S+)$", text, re.M)
            if not kind or kind.group(1) not in ("uprobe_multi", "uretprobe_multi"):
                continue
            path = re.search(r"^path:\s+(.*)$", text, re.M)
            prog = re.search(r"^prog_id:\s+(\d+)$", text, re.M)
            out.append({"pid": pid, "fd": int(fd), "type": kind.group(1), "path": path.group(1) if path else "",
                        "prog_id": int(prog.group(1)) if prog else None,
                        "offsets": [int(o, 16) for o in re.findall(r"^\d+\s+0x([0-9a-f]+)\s+0x[0-9a-f]+$", text, re.M)]})
    return out


def our_links() -> list[dict]:
    """uprobe_multi links this process holds."""
    return uprobe_links([os.getpid()])


@pytest.fixture(scope="module")
def bcc_env():
    from mcp_hostagent.core import kernel

    hc = kernel.find_kernel_headers()
    if hc.bcc_kernel_source:
        os.environ["BCC_KERNEL_SOURCE"] = hc.bcc_kernel_source


def new_bpf(mode):
    from bcc import BPF

    from mcp_hostagent.cuda import uprobes

    b = BPF(text=PROGS)
    return b, uprobes.attacher_for(b, mode)


def attach_all(up, lib: str, pid: int = -1) -> tuple[list, dict[int, str]]:
    """Entry probes on every symbol (program p<i>) and return probes on RET_SYMS (p<32+i>)."""
    from bcc import BPF

    hs, what = [], {}
    for i, s in enumerate(SYMS):
        addr = BPF._check_path_symbol(lib.encode(), s.encode(), None, -1)[1]
        hs.append(up.attach(f"p{i}", lib, addr, pid=pid))
        what[i] = s
        if s in RET_SYMS:
            hs.append(up.attach(f"p{32 + i}", lib, addr, retprobe=True, pid=pid))
            what[32 + i] = s + " (return)"
    return hs, what


def test_feature_probe_says_supported_on_this_kernel():
    from mcp_hostagent.cuda import uprobes

    ok, why = uprobes.multi_supported()
    if not kernel_at_least(6, 10):
        pytest.skip(f"kernel {os.uname().release}: uprobe_multi with a process pid filter is 6.10+ ({why})")
    assert ok and why == ""
    assert uprobes.multi_supported() == (ok, why)  # probed once


def test_env_forces_perf(monkeypatch):
    from mcp_hostagent.cuda import uprobes

    class Obj:
        pass

    monkeypatch.setenv(uprobes.ENV, "perf")
    a = uprobes.attacher_for(Obj())
    assert a.mode == uprobes.PERF and "MCP_UPROBES=perf" in a.mechanism
    monkeypatch.delenv(uprobes.ENV)
    o = Obj()
    assert uprobes.attacher_for(o).mode == (uprobes.MULTI if uprobes.multi_supported()[0] else uprobes.PERF)
    assert uprobes.attacher_for(o) is uprobes.attacher_for(o)


@pytest.mark.parametrize("mode", ["uprobe_multi", "perf"])
def test_counts_match_the_library_and_detach_time(build, bcc_env, mode):  # noqa: F811
    """Every symbol's entry and return probe counts exactly the driver's calls, only in the filtered
    process when a pid is given; detaching all of them (one process's worth of libcuda uprobes) is
    under 1 s with multi links. Perf-event uprobes must count the same; their detach is only timed."""
    from mcp_hostagent.cuda import uprobes

    if mode == uprobes.MULTI and not uprobes.multi_supported()[0]:
        pytest.skip(uprobes.multi_supported()[1])
    b, up = new_bpf(mode)
    assert up.mode == mode
    d, other = Driver(build, build.lib), Driver(build, build.lib)
    try:
        hs, what = attach_all(up, build.lib, pid=d.pid)
        if mode == uprobes.MULTI:
            assert len([x for x in our_links() if x["path"] == os.path.realpath(build.lib)
                        and x["prog_id"] in prog_ids(b)]) == len(hs)
        for i, s in enumerate(SYMS):
            for drv in (d, other):
                drv.do(f"sym {s} {i % 5 + 1}")
        calls = [int(x) for x in d.do("calls")]
        hits = b["hits"]
        got = {k: hits[hits.Key(k)].value for k in what}
        want = {k: calls[SYMS.index(s.split(" ")[0])] for k, s in what.items()}
        assert got == want, {what[k]: (got[k], want[k]) for k in what if got[k] != want[k]}
        assert all(v > 0 for v in want.values())

        t0 = time.monotonic()
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(up.detach, hs))
        took = time.monotonic() - t0
        print(f"{mode}: {len(hs)} uprobes detached in {took:.3f} s")
        d.do(f"sym {SYMS[0]} 3")
        assert hits[hits.Key(0)].value == got[0], "counted after detach"
        if mode == uprobes.MULTI:
            assert took < 1.0
            # only this object's programs: another object in this process may follow the same library
            assert not [x for x in our_links() if x["path"] == os.path.realpath(build.lib)
                        and x["prog_id"] in prog_ids(b)], threading.enumerate()
        else:
            assert not [e for e in b.uprobe_fds if build.lib.replace("/", "_").encode() in e]
    finally:
        d.close()
        other.close()
        b.cleanup()


def test_attach_error_is_one_line_with_errno(build, bcc_env):  # noqa: F811
    from mcp_hostagent.cuda import uprobes

    if not uprobes.multi_supported()[0]:
        pytest.skip(uprobes.multi_supported()[1])
    b, up = new_bpf(None)
    try:
        with pytest.raises(uprobes.AttachError) as e:
            up.attach("p0", build.lib, 1 << 40)  # past the file's end
        assert e.value.errno and "\n" not in str(e.value) and re.search(r"E[A-Z]+ \(", str(e.value))
        with pytest.raises(ValueError):
            uprobes.attacher_for(b, uprobes.PERF)  # the object's programs are loaded for multi links
    finally:
        b.cleanup()


@pytest.mark.parametrize("mode", ["uprobe_multi", "perf"])
def test_uprobe_programs_from_the_compile_cache_count_every_call(monkeypatch, tmp_path, build, mode):  # noqa: F811
    """A start whose uprobe part came from the compile cache loads those programs itself (with the
    expected attach type that uprobe_multi links need, or without for perf-event uprobes): every call
    into the stand-in library's cuLaunchKernel is one hit of the launch counter, as the library
    counts them; the program is the kernel's record of the link (multi)."""
    import ctypes

    from bcc import BPF

    from mcp_hostagent.config import load_config
    from mcp_hostagent.core import compile_cache, kernel, loader
    from mcp_hostagent.cuda import records as R
    from mcp_hostagent.cuda import uprobes
    from mcp_hostagent.registry import UNIT

    if mode == uprobes.MULTI and not uprobes.multi_supported()[0]:
        pytest.skip(uprobes.multi_supported()[1])
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "cache"))
    cfg = load_config(None, env={})
    kernel.prepare(cfg.kernel_headers, cfg.kernel_link_modules_build, report=False)

    def load():
        (got,) = loader.load(UNIT, UNIT.plan(cfg), UNIT.settings(cfg))
        return got

    load().bpf.cleanup()  # fills the cache
    got = load()
    d = None
    try:
        assert got.processes == "from the compile cache", got.processes
        assert b"cu_launch" in got.bpf.adopted and got.bpf.module is None
        up = uprobes.attacher_for(got.bpf, mode)
        addr = BPF._check_path_symbol(build.lib.encode(), b"cuLaunchKernel", None, -1)[1]
        up.attach("cu_launch", build.lib, addr)
        if mode == uprobes.MULTI:
            assert [x for x in our_links() if x["path"] == os.path.realpath(build.lib)
                    and x["prog_id"] in prog_ids(got.bpf)]
        hits = lambda: sum(got.bpf[b"stats"][ctypes.c_int(R.C["MCP_STAT_CU_LAUNCH_HITS"])])  # noqa: E731
        before = hits()
        d = Driver(build, build.lib)
        d.do("launch 7")
        calls = [int(x) for x in d.do("calls")]
        assert calls[0] == 7 and hits() - before == calls[0]
    finally:
        if d is not None:
            d.close()
        got.bpf.cleanup()
