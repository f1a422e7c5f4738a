"""Real BPF on a stand-in libcuda: uprobes on tests/c/fake_libcuda.c (the driver API symbols with their
real signatures), called in patterns by tests/c/cuda_driver.c; ground truth from the library's own call
counters, the driver's commands, and strace for ioctls.

There is no NVIDIA device here and /dev/nvidia* cannot be made: the fd filter's globs are a setting, and
these tests register a plain file under /dev/shm as an NVIDIA device file and issue ioctls on it (they
fail with ENOTTY but for FIONREAD, which is fine: syscalls:sys_enter/exit_ioctl fire either way).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from conftest import RunningAgent, identity_on_resource_only, wait_port

pytestmark = pytest.mark.bpf

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE_DEV_GLOB = "/dev/shm/mcp-fake-nvidia*"
LAUNCH_SYMS = ("cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz")


def _cc(args):
    subprocess.run(["cc", "-O2", "-Wall", "-Werror", *args], check=True)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    from mcp_hostagent.core.records import bpf_source_dir

    d = tmp_path_factory.mktemp("cuda")
    src = os.path.join(HERE, "c")
    for sub, extra in (("host", []), ("old", ["-DFAKE_NO_PTSZ"])):
        os.makedirs(d / sub)
        _cc(["-shared", "-fPIC", "-fno-ipa-icf", *extra, "-o", str(d / sub / "libcuda.so.1"),
             os.path.join(src, "fake_libcuda.c"), "-lpthread"])
    _cc([f"-I{bpf_source_dir()}", "-o", str(d / "cuda_driver"), os.path.join(src, "cuda_driver.c"), "-ldl", "-lpthread"])
    return SimpleNamespace(dir=d, lib=str(d / "host" / "libcuda.so.1"), old=str(d / "old" / "libcuda.so.1"),
                           drv=str(d / "cuda_driver"))


@pytest.fixture(scope="module")
def gpu(build):
    """The agent (process.watch = gpu) with its CUDA probes replaced by ones with test settings (the
    fake NVIDIA device glob, no governor budget pressure); GPU step records are also collected here."""
    from mcp_hostagent.cuda import probeset as cuda

    from mcp_hostagent.core.decode import Route
    from mcp_hostagent.cuda.steps import EV_GPU_STEP

    ra = RunningAgent({"process.watch": "gpu"})
    steps = []
    r = ra.agent.routes[EV_GPU_STEP]
    ra.agent.routes[EV_GPU_STEP] = Route(r.struct, r.build, (steps.append, *r.handlers))
    if ra.agent.caps["cuda"].probes is not None:  # the pipeline's own, replaced by one with test settings
        ra.agent.caps["cuda"].probes.stop()
    cp = cuda.CudaProbes(ra.agent.bpf, ra.agent.plan, budget=1.0, device_globs=("/dev/nvidia*", FAKE_DEV_GLOB),
                         slice_s=0.1)
    cp.start()
    ra.agent.caps["cuda"].probes = cp
    yield SimpleNamespace(ra=ra, cp=cp, steps=steps, bpf=ra.agent.bpf)
    cp.stop()
    ra.close()


class Driver:
    def __init__(self, build, lib: str | None, prefix=()):
        self.p = subprocess.Popen([*prefix, build.drv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  bufsize=1)
        self.pid = int(self.do("pid")[0])
        self.missing = int(self.do(f"lib {lib}")[0]) if lib else None

    def do(self, cmd: str) -> list[str]:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        out = self.p.stdout.readline().split()
        assert out and out[0] == "ok", f"driver: {cmd!r} -> {out}"
        return out[1:]

    def close(self):
        if self.p.poll() is None:
            self.p.stdin.write("exit\n")
            self.p.stdin.flush()
            self.p.wait(10)


@pytest.fixture
def drivers(build):
    made = []

    def make(lib=None, prefix=()):
        d = Driver(build, build.lib if lib is None else lib, prefix)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


def wait_attached(gpu, path: str, pid: int, timeout: float = 8.0) -> float:
    """Seconds until the library file at path is attached and known to map into pid."""
    ino, t0 = os.stat(path).st_ino, time.monotonic()
    while time.monotonic() - t0 < timeout:
        for key, lib in gpu.cp.libraries().items():
            if key[2] == ino and pid in lib.pids and all(
                    st.events for st in lib.syms.values() if st.state == "attached"):  # the duty cycler's too
                return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"{path} not attached for pid {pid} within {timeout}s: {gpu.cp.symbol_rows()[:3]}")


def proc(gpu, pid: int):
    from mcp_hostagent.core.decode import counters_from

    return counters_from(gpu.bpf[b"proc_stats"][ctypes.c_uint32(pid)])


def fake_calls(d: Driver) -> list[int]:
    return [int(x) for x in d.do("calls")]


def test_exact_counts_per_request_and_process(gpu, build, drivers):
    d = drivers()
    wait_attached(gpu, build.lib, d.pid)
    d.do("sym cuCtxSetCurrent 1")  # the first CUDA call puts the process in the watch set
    c0 = proc(gpu, d.pid)
    script = ("begin 501;launch 25;sym cuGraphLaunch 3;sym cuGraphLaunch_ptsz 1;sym cuCtxPushCurrent_v2 3;"
              "sym cuCtxPopCurrent_v2 3;syncns 2000000;sym cuStreamSynchronize 2;sym cuMemAlloc_v2 2;"
              "sym cuMemAllocAsync 1;sym cuMemFree_v2 2;syncns 0;end 501")
    tid = int(d.do(f"thread {script}")[0])
    d.do("launch 10")  # outside any request: per process only
    d.do("sym cuCtxPushCurrent 4")
    (span,) = gpu.ra.wait_spans(1, **{"process.pid": d.pid, "hostagent.request.id": f"{501:016x}"})
    a = span.attributes
    assert a["thread.id"] == tid
    for s in LAUNCH_SYMS:
        assert a[f"hostagent.cuda.launches.{s}"] == 25, s
    assert a["hostagent.cuda.graph_launches"] == 4
    assert a["hostagent.cuda.ctx.count"] == 6 and a["hostagent.cuda.ctx.time"] > 0
    assert a["hostagent.cuda.sync.count"] == 2
    # each sync sleeps 2 ms; the rest is two uprobe traps (~10 us each here) and the wake-up, which on
    # this shared 2-CPU VM can take milliseconds (seconds on the span: the kernel's ns / 1e9)
    assert 4_000_000 / 1e9 <= a["hostagent.cuda.sync.time"] < (4_000_000 + 6_000_000) / 1e9
    assert a["hostagent.cuda.alloc.count"] == 3 and a["hostagent.cuda.free.count"] == 2
    assert a.get("hostagent.cuda.sampled", 0) == 0
    d1 = proc(gpu, d.pid) - c0
    assert (d1.cu_launch, d1.cu_launch_ptsz, d1.cu_launch_ex, d1.cu_launch_ex_ptsz) == (35, 35, 35, 35)
    assert (d1.cu_graph_launch, d1.cu_ctx_ops, d1.cu_syncs, d1.cu_allocs, d1.cu_frees) == (4, 10, 2, 3, 2)
    # and all of the library's own count since the process started: nothing missed, nothing twice
    calls = fake_calls(d)
    total = proc(gpu, d.pid)
    assert [total.cu_launch, total.cu_launch_ptsz, total.cu_launch_ex, total.cu_launch_ex_ptsz] == calls[:4]
    assert total.cu_ctx_ops == sum(calls[6:11])
    assert identity_on_resource_only(span)["process.executable.name"] == "cuda_driver"
    # the sync latency histogram: the two syncs, each 2-8 ms (the span's total above); slot s holds
    # [2^(s-1), 2^s - 1] ns, so each one's slot brackets it
    syncs = [r for r in gpu.cp.hist_rows() if r["pid"] == d.pid and r["kind"] == "sync"]
    assert sum(r["count"] for r in syncs) == 2
    assert all(r["le_ns"] == (1 << r["slot"]) - 1 for r in syncs)
    assert all(r["le_ns"] >= 2_000_000 and 1 << (r["slot"] - 1) < 8_000_000 for r in syncs), syncs
    # and as exported: one histogram point for the process's syncs, in seconds, both in buckets
    # bounded by 2^s - 1 ns with 2 ms <= bound and the bucket below under 8 ms
    point = _call_duration_point(gpu, d.pid, "sync", count=2)
    assert point.count == 2 and sum(point.bucket_counts) == 2
    bounds = list(point.explicit_bounds) + [float("inf")]
    for i, n in enumerate(point.bucket_counts):
        if n:
            assert bounds[i] >= 0.002 and (i == 0 or bounds[i - 1] < 0.008), (i, bounds)


def _call_duration_point(gpu, pid: int, kind: str, count: int, timeout: float = 5.0):
    """The exported hostagent.cuda.call.duration point of (pid, kind) once it counts `count` calls (the
    rows are published once a tick)."""
    deadline = time.monotonic() + timeout
    while True:
        points = [p for m in gpu.ra.agent.telemetry.kernel_histograms() if m.name == "hostagent.cuda.call.duration"
                  for p in m.data.data_points
                  if dict(p.attributes) == {"process.pid": pid, "hostagent.cuda.kind": kind}]
        if (points and points[0].count >= count) or time.monotonic() > deadline:
            assert len(points) == 1, points
            return points[0]
        time.sleep(0.1)


def test_second_copy_is_another_inode_attached_separately(gpu, build, drivers):
    """A container's libcuda is another file: a copy at another path stands for it."""
    ctr = build.dir / "ctr" / "usr" / "lib" / "x86_64-linux-gnu"
    os.makedirs(ctr, exist_ok=True)
    path = str(ctr / "libcuda.so.1")
    shutil.copy(build.lib, path)
    assert os.stat(path).st_ino != os.stat(build.lib).st_ino
    d = drivers(path)  # started after the agent: found through its exec and the maps rescans
    secs = wait_attached(gpu, path, d.pid)
    assert secs < 5
    d.do("launch 50")
    d.do("sym cuCtxSynchronize 2")
    c = proc(gpu, d.pid)
    assert (c.cu_launch, c.cu_launch_ptsz, c.cu_launch_ex, c.cu_launch_ex_ptsz, c.cu_syncs) == (50, 50, 50, 50, 2)
    keys = {r["file"] for r in gpu.cp.symbol_rows() if r["library"] == path}
    assert len(keys) == 1 and str(os.stat(path).st_ino) in keys.pop()


def test_a_library_only_in_the_process_mount_namespace(gpu, build, drivers, tmp_path):
    """A container's libcuda: at a path that, in the agent's mount namespace, names nothing. It is
    reached through /proc/PID/root and trusted there (root's tmpfs, root's file), then counted."""
    mnt = tmp_path / "ctr-lib"
    mnt.mkdir()
    path = str(mnt / "libcuda.so.1")
    d = drivers(path, prefix=["unshare", "-m", "--propagation", "private", "sh", "-c",
                              'mount -t tmpfs -o mode=0755 mcp-ctr "$0" && cp "$1" "$0/" && exec "$2"',
                              str(mnt), build.lib])
    assert not os.path.exists(path)  # not in this mount namespace
    ino = os.stat(f"/proc/{d.pid}/root{path}").st_ino
    deadline = time.monotonic() + 10
    while not any(k[2] == ino and d.pid in lib.pids for k, lib in gpu.cp.libraries().items()):
        assert time.monotonic() < deadline, (gpu.cp.symbol_rows()[:3], gpu.cp.refused)
        time.sleep(0.05)
    wait_attached(gpu, f"/proc/{d.pid}/root{path}", d.pid)
    d.do("launch 30")
    c = proc(gpu, d.pid)
    assert (c.cu_launch, c.cu_launch_ptsz, c.cu_launch_ex, c.cu_launch_ex_ptsz) == (30, 30, 30, 30)


def test_missing_symbols_degrade_per_symbol(gpu, build, drivers):
    d = drivers(build.old)
    assert d.missing == 2  # cuLaunchKernelEx_ptsz, cuStreamSynchronize_ptsz
    wait_attached(gpu, build.old, d.pid)
    rows = {r["symbol"]: r for r in gpu.cp.symbol_rows() if r["library"] == build.old}
    for s in ("cuLaunchKernelEx_ptsz", "cuStreamSynchronize_ptsz"):
        assert rows[s]["state"] == "missing" and "not exported by" in rows[s]["reason"], rows[s]
    assert all(r["state"] == "attached" for s, r in rows.items() if not s.endswith("Ex_ptsz")
               and s != "cuStreamSynchronize_ptsz")
    st = gpu.ra.agent.plan.statuses
    assert st["cuda_launch"].state == "armed" and "cuLaunchKernelEx_ptsz not exported" in st["cuda_launch"].reason
    d.do("launch 20")
    c = proc(gpu, d.pid)
    assert (c.cu_launch, c.cu_launch_ptsz, c.cu_launch_ex, c.cu_launch_ex_ptsz) == (20, 20, 20, 0)


def test_latency_pairs_survive_a_thread_dying_inside_a_call(gpu, build, drivers):
    from mcp_hostagent.core import records as R
    from mcp_hostagent.cuda import records as CU

    d = drivers()
    wait_attached(gpu, build.lib, d.pid)
    d.do("sym cuCtxSetCurrent 1")
    miss0, stale0 = gpu.ra.kernel_stat("cu_pair_miss"), gpu.ra.kernel_stat("cu_pair_stale")
    tid = int(d.do("block")[0])  # a thread inside cuEventSynchronize, blocked
    key = CU.CuPendKey(tid, CU.C["MCP_CU_SYNC"])
    pending = gpu.bpf[b"cu_pending"]
    assert pending.get(key) is not None
    d.do("kill")  # SIGUSR1 -> SYS_exit on that thread, inside the call: its uretprobe never fires
    assert pending.get(key) is None  # sched_process_exit dropped its entry
    c0 = proc(gpu, d.pid)
    d.do("syncns 1000000")
    d.do("sym cuEventSynchronize 3")
    d.do("thread sym cuStreamSynchronize 2")
    c1 = proc(gpu, d.pid) - c0
    assert c1.cu_syncs == 5
    assert 5_000_000 <= c1.cu_sync_ns < 5_000_000 + 8_000_000
    assert gpu.ra.kernel_stat("cu_pair_miss") == miss0
    assert gpu.ra.kernel_stat("cu_pair_stale") == stale0


def test_gpu_steps_zero_touch(gpu, build, drivers):
    d = drivers()
    wait_attached(gpu, build.lib, d.pid)
    d.do("syncns 1000000")
    tid = int(d.do("thread steps 4 7")[0])
    marked = int(d.do("thread begin 701;steps 2 3;end 701")[0])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len([s for s in gpu.steps if s.hdr.tid == tid]) < 4:
        time.sleep(0.05)
    mine = sorted((s for s in gpu.steps if s.hdr.tid == tid), key=lambda s: s.hdr.ts_ns)
    assert len(mine) == 4
    for i, s in enumerate(mine):
        assert s.hdr.tgid == d.pid and s.sync_kind == "stream"
        assert s.launches == s.counters.cu_launch == 7
        assert s.counters.cu_syncs == 1 and s.sync_ns >= 1_000_000
        assert s.counters.cu_sync_ns == s.sync_ns
        assert s.begin_ns < s.hdr.ts_ns
        if i:
            assert s.begin_ns == mine[i - 1].hdr.ts_ns  # a step begins where the last one's sync returned
    assert not [s for s in gpu.steps if s.hdr.tid == marked]  # inside requests, spans not steps
    # Steps go to histograms; a span only for an outlier (steps.OutlierGate): none for these ~1 ms
    # steps, one for a step of 80 ms after the process's mean settled at ~1 ms.
    d.do("thread steps 12 7")
    d.do("syncns 80000000")
    d.do("steps 1 7")
    deadline = time.monotonic() + 10
    while not [s for s in gpu.ra.spans(**{"process.pid": d.pid}) if s.name == "hostagent.gpu_step"]:
        assert time.monotonic() < deadline, "no gpu_step span for the 80 ms step"
        time.sleep(0.1)
    time.sleep(0.5)  # and no other: the ~1 ms steps stay in the histograms
    spans = [s for s in gpu.ra.spans(**{"process.pid": d.pid}) if s.name == "hostagent.gpu_step"]
    assert len(spans) == 1, [dict(s.attributes) for s in spans]
    (sp,) = spans
    assert sp.attributes["thread.id"] == d.pid  # the main thread's 80 ms step
    assert sp.attributes["hostagent.cuda.launches.cuLaunchKernel"] == 7
    assert sp.attributes["hostagent.gpu_step.sync.time"] >= 0.08  # seconds
    assert sp.attributes["process.pid"] == d.pid and sp.attributes["hostagent.gpu_step.sync.kind"] == "stream"
    res = identity_on_resource_only(sp)  # the process's identity is the step span's resource
    assert res["process.pid"] == d.pid and res["process.executable.name"] == "cuda_driver"


def test_ioctls_on_nvidia_fds_match_strace(gpu, build, drivers, tmp_path):
    dev = f"/dev/shm/mcp-fake-nvidia{os.getpid()}"
    log = tmp_path / "strace.log"
    d = drivers(prefix=["strace", "-f", "-C", "-X", "raw", "-y", "-e", "trace=ioctl", "-o", str(log)])
    try:
        wait_attached(gpu, build.lib, d.pid)
        # Watched from its first CUDA call: an entry-only one. Since Linux 6.11 an x86-64 uretprobe returns
        # through syscall 335 (uretprobe), which strace 6.1 cannot name, and its -c summary then crashes.
        d.do("sym cuGraphLaunch 1")
        fd = int(d.do(f"open {dev}")[0])
        other = int(d.do("open /dev/null")[0])
        gpu.cp.scan_fds([d.pid])  # what the agent does every fd_scan_s
        c0 = proc(gpu, d.pid)
        d.do("begin 601")
        d.do(f"ioctl {fd} 40 0xc020462a")  # _IOWR('F', 0x2a, 32): the shape of an nvidiactl call
        d.do(f"ioctl {fd} 25 0x541b")      # FIONREAD
        d.do(f"ioctl {other} 30 0x541b")   # not an NVIDIA fd: strace sees it, we must not count it
        d.do("end 601")
        d.do(f"ioctl {fd} 15 0x30")        # a bare number, as nvidia-uvm's commands are
        c1 = proc(gpu, d.pid) - c0
        ours = {int(r["cmd"], 16): r["count"] for r in gpu.cp.ioctl_rows() if r["pid"] == d.pid and r["device"] == dev}
        ns = sum(r["ns"] for r in gpu.cp.ioctl_rows() if r["pid"] == d.pid)
    finally:
        d.close()
        os.unlink(dev)
    text = log.read_text()
    theirs: dict[int, int] = {}
    for m in re.finditer(rf"ioctl\(\d+<{re.escape(dev)}>, (0x[0-9a-f]+)", text):
        theirs[int(m.group(1), 16)] = theirs.get(int(m.group(1), 16), 0) + 1
    summary = int(re.search(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+\d*\s*ioctl$", text, re.M).group(1))
    assert ours == theirs == {0xC020462A: 40, 0x541B: 25, 0x30: 15}
    assert c1.nv_ioctls == 80 and c1.nv_ioctl_ns > 0 and ns >= c1.nv_ioctl_ns
    assert summary >= 80 + 30  # strace -c counts every ioctl of the process: markers, /dev/null, libc's
    (span,) = gpu.ra.wait_spans(1, **{"process.pid": d.pid, "hostagent.request.id": f"{601:016x}"})
    assert span.attributes["hostagent.nvidia.ioctl.count"] == 65


def test_duty_cycle_scales_and_marks_sampled(gpu, build, drivers):
    """A tiny budget: launches counted 1/weight of the time, each hit counting weight. The driver launches
    on a fixed timeline (2,000/s for 12 s, sleeping between), so the probe's cost does not change its
    rate: the estimate's error is the slices cut at the window's edges, at most 2 x slice x weight /
    window (5% here), plus scheduling delays of the agent's thread around attach and detach; we allow
    10%."""
    d = drivers()
    wait_attached(gpu, build.lib, d.pid)
    d.do("sym cuCtxSetCurrent 1")
    # only processes holding an NVIDIA device fd steer the weights (a real one opens nvidiactl at cuInit)
    d.do(f"open {FAKE_DEV_GLOB[:-1]}-duty")
    deadline = time.monotonic() + 5
    while d.pid not in gpu.cp._fds and time.monotonic() < deadline:
        time.sleep(0.1)
    assert d.pid in gpu.cp._fds
    # The governor sets one weight per symbol from the busiest process's rate; launches of earlier
    # tests' drivers (their last window is counted as an unwatched "rest" once they exit) must have
    # left its estimate before the weight is computed for this driver alone.
    deadline = time.monotonic() + 15
    while sum(sum(r.values()) for r in gpu.cp.rates.values()) > 50 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sum(sum(r.values()) for r in gpu.cp.rates.values()) <= 50, gpu.cp.rates
    cost = gpu.cp.calibration.cost_ns
    gpu.cp.set_budget(2000 * cost * 1e-9 / 2.5)  # -> weight 3 at 2,000 launches/s
    try:
        c0 = proc(gpu, d.pid)
        d.do("paced 24000 2000")
        c1 = proc(gpu, d.pid)
        status = gpu.cp.governor_status()
    finally:
        gpu.cp.set_budget(1.0)
    est = c1.cu_launch - c0.cu_launch
    assert status["weight"] >= 2 and status["toggles"] > 0, status
    assert c1.sampled >= 2  # the weight of the last hits counted
    assert abs(est - 24000) / 24000 < 0.10, (est, status)
    assert gpu.cp.weight == 1  # back to exact counting
    assert fake_calls(d)[0] == 24000  # the library's truth


def test_duty_cycled_request_counts_are_exact_estimated_or_absent_never_a_false_zero(gpu, build, drivers):
    """Issue 14: with the launch probes duty-cycled (weight 3, slices of 0.1 s), 150 requests of 40
    launches each (20 ms apiece at 2,000/s): a request whose window the probe covered says 40 exactly
    and carries no coverage; one it covered in part carries the coverage and an estimate (hits /
    coverage) near 40; one it never surely covered leaves the count off (unknown) with coverage 0.
    The H200 version, two PyTorch processes against torch.profiler: tests/fixtures/cuda/
    h200_coverage_check.py (docs/PERFORMANCE.md). Before, a
    request in an off-slice said 0 unflagged, and one in an on-slice said 3 x 40."""
    d = drivers()
    wait_attached(gpu, build.lib, d.pid)
    d.do(f"open {FAKE_DEV_GLOB[:-1]}-cov")  # a GPU user steers the weights
    deadline = time.monotonic() + 5
    while d.pid not in gpu.cp._fds and time.monotonic() < deadline:
        time.sleep(0.1)
    deadline = time.monotonic() + 15
    while sum(sum(r.values()) for r in gpu.cp.rates.values()) > 50 and time.monotonic() < deadline:
        time.sleep(0.2)
    cost = gpu.cp.calibration.cost_ns
    gpu.cp.set_budget(2000 * cost * 1e-9 / 2.5)  # -> weight 3 at 2,000 launches/s
    try:
        d.do("paced 6000 2000")  # 3 s: the governor sees the rate and duty-cycles
        assert gpu.cp.weight >= 2, gpu.cp.governor_status()
        d.do("reqs 150 40 2000 900000")
        status = gpu.cp.governor_status()
    finally:
        gpu.cp.set_budget(1.0)
    spans = gpu.ra.wait_spans(150, timeout=15, **{"process.pid": d.pid})
    spans = [s for s in spans if int(s.attributes["hostagent.request.id"], 16) >= 900000]
    assert len(spans) == 150, (len(spans), status)
    exact = partial = unknown = 0
    est = []
    for s in spans:
        a = s.attributes
        n, cov = a.get("hostagent.cuda.launches.cuLaunchKernel"), a.get("hostagent.cuda.coverage.cuLaunchKernel")
        if cov is None:
            exact += 1
            assert n == 40, sorted(a.items())  # exact means exact
        elif cov == 0:
            unknown += 1
            assert n is None, dict(a)  # unknown is absent, not 0
        else:
            partial += 1
            assert 0 < cov < 1 and n is not None, dict(a)
            est.append(n)
    # weight 3 of 0.1 s slices: on 1/3 of the time; 20 ms requests fall inside, outside and across
    # (seen: 44 exact, 23 estimated, 83 unknown)
    assert exact >= 10 and unknown + partial >= 30, (exact, partial, unknown, status)
    # Estimates are rough: each attach stalls the launching thread for its duration (~10 ms here) and
    # the paced driver catches up, so hits are not spread as the on-time is (seen: 6..45 for 40,
    # mean 30). Labelled, they stay within reason on the whole.
    if len(est) >= 5:
        assert 0.5 <= sum(est) / (40 * len(est)) <= 1.5, sorted(est)
    assert fake_calls(d)[0] == 6000 + 150 * 40  # the library's truth


def test_library_detach_is_fast_with_uprobe_multi_links(gpu, build, drivers, tmp_path):
    """All of one library's uprobes (entry and return, duty-cycled launch probes included) go within 1 s
    with uprobe_multi links; each perf-event uprobe waits out its own grace period (3-9 s for a process's
    ~40 on these VMs), which is what broke the 5 s SIGTERM promise."""
    from mcp_hostagent.cuda import uprobes
    from test_bpf_uprobes import our_links

    mode = gpu.cp.governor_status()["uprobes"]
    assert mode == uprobes.attacher_for(gpu.bpf).mode
    if uprobes.multi_supported()[0] and not os.environ.get(uprobes.ENV):
        assert mode == uprobes.MULTI
    lib = tmp_path / "libcuda.so.1"  # its own inode: no other test's library is touched
    shutil.copy(build.lib, lib)
    d = drivers(str(lib))
    wait_attached(gpu, str(lib), d.pid)
    key = next(k for k in gpu.cp.libraries() if k[2] == os.stat(lib).st_ino)
    n = sum(len(st.events) for st in gpu.cp.libs[key].syms.values())
    assert n >= 30
    if mode == uprobes.MULTI:
        assert len([x for x in our_links() if x["path"] == str(lib)]) == n
    d.close()
    with gpu.cp._lock:
        t0 = time.monotonic()
        gpu.cp._drop(gpu.cp.libs[key])
        took = time.monotonic() - t0
    print(f"{n} uprobes of one library ({mode}) detached in {took:.3f} s")
    assert not [x for x in our_links() if x["path"] == str(lib)]
    if mode == uprobes.MULTI:
        assert took < 1.0


def test_a_request_says_what_the_gpu_steps_beside_it_did(gpu, build, drivers):
    """A batching engine's steps (another thread here; another process of the cgroup alike) feed the
    requests in flight: how many steps, the slowest, their launches and sync time, on the request."""
    d = drivers()
    wait_attached(gpu, build.lib, d.pid)
    d.do("syncns 2000000")
    d.do("steps 1 1")  # before the request: not in it
    d.do("begin 801")
    d.do("thread steps 3 5")
    time.sleep(0.3)  # the step records are read (events ring) before the END (req_events ring)
    d.do("end 801")
    d.do("thread steps 2 9")  # after it: not in it
    deadline = time.monotonic() + 10
    while not (got := gpu.ra.spans(**{"process.pid": d.pid, "hostagent.request.id": f"{801:016x}"})):
        assert time.monotonic() < deadline, "no span for request 801"
        time.sleep(0.1)
    a = got[0].attributes
    assert a["hostagent.request.gpu_steps.count"] == 3, dict(a)
    assert a["hostagent.request.gpu_steps.launches"] == 15
    assert a["hostagent.request.gpu_steps.processes"] == 1
    assert 0.002 <= a["hostagent.request.gpu_steps.duration.max"] < a["hostagent.request.gpu_steps.sync.time"] + 0.01
    assert 3 * 0.002 <= a["hostagent.request.gpu_steps.sync.time"] < 3 * 0.002 + 0.03
    assert "hostagent.cuda.launches.cuLaunchKernel" not in a  # the request's own thread launched nothing


def test_out_of_memory_allocations_are_counted_from_their_return_value(gpu, build, drivers):
    d = drivers()
    wait_attached(gpu, build.lib, d.pid)
    d.do("sym cuMemAlloc_v2 1")  # a first call: the process's counters exist
    before = proc(gpu, d.pid)
    d.do("allocresult 2")  # CUDA_ERROR_OUT_OF_MEMORY
    d.do("begin 901")
    d.do("sym cuMemAlloc_v2 3")
    d.do("end 901")
    d.do("allocresult 0")
    d.do("sym cuMemAlloc_v2 2")
    after = proc(gpu, d.pid)
    assert after.cu_alloc_oom - before.cu_alloc_oom == 3
    assert after.cu_allocs - before.cu_allocs == 5
    (span,) = gpu.ra.wait_spans(1, **{"process.pid": d.pid, "hostagent.request.id": f"{901:016x}"})
    assert span.attributes["hostagent.cuda.alloc.out_of_memory"] == 3
    assert span.attributes["hostagent.cuda.alloc.count"] == 3


def test_governor_recalibrates_and_weighs_by_the_highest_recent_cost(gpu, build, drivers):
    """The per-hit calibration runs in the finder thread once a library is followed (not in start-up)
    and again every RECALIBRATE_S; the cost the weights use is the highest of the last few, each a
    real timing of our launch program on the stand-in (trap included: microseconds in this VM)."""
    from mcp_hostagent.cuda import governor as gov

    d = drivers()
    wait_attached(gpu, build.lib, d.pid)
    deadline = time.monotonic() + 10
    while not gpu.cp.costs and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(gpu.cp.costs) == 1, gpu.cp.errors
    for want in (2, 3):
        gpu.cp._next_calibration = 0.0  # due now, instead of in RECALIBRATE_S
        gpu.cp._wake.set()
        deadline = time.monotonic() + 10
        while len(gpu.cp.costs) < want and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(gpu.cp.costs) == want, gpu.cp.errors
    assert all(100 < c < 1e6 for c in gpu.cp.costs), gpu.cp.costs
    assert gpu.cp.calibration.cost_ns == max(gpu.cp.costs) == gov.charged_cost(gpu.cp.costs)
    assert gpu.cp._next_calibration > time.monotonic() + gov.RECALIBRATE_S / 2


@pytest.mark.parametrize("start_round", [True, False])
def test_a_cuda_process_running_before_the_agent_is_armed_when_start_returns(monkeypatch, build, drivers, start_round):
    """The finder's walk over /proc is budgeted per pass (finder.RESCAN_BUDGET_S; here one pid per pass);
    at start its first round runs pass after pass for up to START_ROUND_S, so a library mapped before
    the agent started has its uprobes when Agent.start returns (READY=1), not a pass or more later.
    Without the start round (START_ROUND_S = 0) the same start leaves it unfollowed: the check can fail."""
    from mcp_hostagent.cuda import probeset as cuda

    d = drivers()
    pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    assert len(pids) > 10 and d.pid != pids[0], "one pass would reach the driver's pid anyway"
    monkeypatch.setattr(cuda, "RESCAN_BUDGET_S", 0.0)  # a pass visits one pid
    if not start_round:
        monkeypatch.setattr(cuda, "START_ROUND_S", 0.0)
    ra = RunningAgent({"process.watch": "gpu"})
    try:
        libs = ra.agent.caps["cuda"].probes.libraries()  # read at once: the finder's thread has had no pass of its own yet
        ino = os.stat(build.lib).st_ino
        armed = [lib for key, lib in libs.items() if key[2] == ino
                 and any(st.state == "attached" for st in lib.syms.values())]
        assert bool(armed) == start_round, [(lib.shown, lib.pids) for lib in libs.values()]
    finally:
        ra.close()


def _http_server(build, port: int, rate: int = 0, dev: str | None = None):
    import sys

    p = subprocess.Popen([sys.executable, os.path.join(HERE, "http", "cuda_http_server.py"), build.lib, str(port),
                          str(rate), *([dev] if dev else [])])
    wait_port(port, p, 20)
    return p


def _get(conn, path: str, tp: str):
    import json

    conn.request("GET", path, headers={"traceparent": tp})
    r = conn.getresponse()
    return json.loads(r.read())


def test_zero_code_requests_count_the_launches_of_their_thread_and_process_exactly(gpu, build):
    """An unmodified HTTP server (no marker) that launches in the thread serving each request: the
    span's thread and process counts are the library's own, request by request (no duty cycling)."""
    import http.client
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = _http_server(build, port)
    try:
        wait_attached(gpu, build.lib, p.pid, timeout=15)
        conn = http.client.HTTPConnection("127.0.0.1", port)
        _get(conn, "/launch?n=1", "00-" + "a" * 32 + "-" + "b" * 16 + "-01")  # watched by its first call
        sent = []
        for i in range(20):
            tp = f"00-{0xC0DA00 + i:032x}-{0xC0DA00 + i:016x}-01"
            before = _get(conn, "/calls", "00-" + "c" * 32 + "-" + "d" * 16 + "-01")["calls"]
            got = _get(conn, f"/launch?n={5 + 3 * i}", tp)
            sent.append((0xC0DA00 + i, got["calls"] - before, got["tid"]))
        conn.close()
        for trace, n, tid in sent:
            deadline = time.monotonic() + 10
            while True:
                spans = [x for x in gpu.ra.spans() if x.parent is not None and x.parent.trace_id == trace]
                if spans or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert len(spans) == 1, trace
            a = spans[0].attributes
            assert a["hostagent.request.source"] == "http" and a["thread.id"] == tid
            assert a["hostagent.cuda.launches.cuLaunchKernel"] == n, dict(a)
            assert a["hostagent.request.process.cuda.launches.cuLaunchKernel"] == n, dict(a)
            assert "hostagent.cuda.coverage.cuLaunchKernel" not in a  # exact: no coverage said
    finally:
        p.kill()
        p.wait()


def test_duty_cycled_zero_code_counts_are_exact_estimated_or_absent_per_scope(gpu, build):
    """As the marked requests' test above, for zero-code ones: with the launch probe duty-cycled,
    each scope's count is exact (no coverage), labelled with its coverage, or absent with coverage 0."""
    import http.client
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = _http_server(build, port, rate=2000, dev=f"{FAKE_DEV_GLOB[:-1]}-http")
    try:
        wait_attached(gpu, build.lib, p.pid, timeout=15)
        deadline = time.monotonic() + 5
        while p.pid not in gpu.cp._fds and time.monotonic() < deadline:
            time.sleep(0.1)
        cost = gpu.cp.calibration.cost_ns
        gpu.cp.set_budget(2000 * cost * 1e-9 / 2.5)  # -> weight 3 at 2,000 launches/s
        try:
            deadline = time.monotonic() + 15
            while gpu.cp.weight < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert gpu.cp.weight >= 2, gpu.cp.governor_status()
            conn = http.client.HTTPConnection("127.0.0.1", port)
            for i in range(60):
                _get(conn, "/launch?n=40&gap_us=500", f"00-{0xD0DA00 + i:032x}-{0xD0DA00 + i:016x}-01")
            conn.close()
        finally:
            gpu.cp.set_budget(1.0)
        spans = []
        deadline = time.monotonic() + 15
        while len(spans) < 60 and time.monotonic() < deadline:
            spans = [x for x in gpu.ra.spans() if x.parent is not None and 0xD0DA00 <= x.parent.trace_id < 0xD0DA00 + 60]
            time.sleep(0.2)
        assert len(spans) == 60
        seen = Counter()
        for x in spans:
            a = x.attributes
            for prefix in ("hostagent.", "hostagent.request.process."):
                n = a.get(prefix + "cuda.launches.cuLaunchKernel")
                cov = a.get(prefix + "cuda.coverage.cuLaunchKernel")
                if cov is None:
                    seen[prefix, "exact"] += 1
                    if prefix == "hostagent.":
                        assert n == 40, dict(a)  # the thread's: exact means exact
                elif cov == 0:
                    seen[prefix, "unknown"] += 1
                    assert n is None, dict(a)  # unknown is absent, never a false 0
                else:
                    seen[prefix, "estimate"] += 1
                    assert 0 < cov < 1 and n is not None, dict(a)
        # the process scope has the steady thread's launches too, scaled: never said exact unless
        # the probe was on throughout, and never 0 for a window it was off
        assert seen["hostagent.", "unknown"] + seen["hostagent.", "estimate"] > 0, seen
        assert seen["hostagent.request.process.", "unknown"] + seen["hostagent.request.process.", "estimate"] > 0, seen
    finally:
        p.kill()
        p.wait()

