"""`mcp-agent top`: the snapshot model (rates, percentiles, findings, NIC link events), the renderer
at 80x24 and 200x50 with hostile process and interface names, the keys, the control socket and its
group; then the real thing: tmux runs `mcp-agent top` against real BPF while a marked child makes
requests and page faults and a driver calls a stand-in libcuda (tests/c), and `send-keys` drives it;
`mcp-agent run` serves its snapshots on the socket and `top --json`/`--once` attach, also from a
network namespace whose veth pair goes down and up, and as users in and out of control.group.

GPU figures come from the NVML answers and the sysfs tree recorded on an H200 (tests/nvml_replay.py,
tests/fixtures/gpu), through the real sampler and poller: this machine has no GPU."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import unicodedata
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import pytest

from mcp_hostagent import control
from mcp_hostagent.top.keys import KEY_DOWN, KEY_ENTER, KEY_ESC, handle_key
from mcp_hostagent.top.layout import ViewState, layout, sorted_rows
from mcp_hostagent.top.render import frame_text, render
from mcp_hostagent.top.sources import LOCAL_STOP_S
from mcp_hostagent.top.text import cells, fit, line_text
from mcp_hostagent.core.decode import Counters
from mcp_hostagent.core.request import FinishedRequest
from mcp_hostagent.nic.netlink import LinkEvent, NicState
from mcp_hostagent.reclaim.rule import Episode, KswapdTracker
from mcp_hostagent.cuda.section import CudaSection
from mcp_hostagent.gpuhealth.capability import GpuHealth
from mcp_hostagent.gpuhealth.section import GpuSection
from mcp_hostagent.nic.section import NicSection
from mcp_hostagent.pcie.section import PcieSection
from mcp_hostagent.reclaim.memstat import parse_meminfo
from mcp_hostagent.reclaim.section import ReclaimSection
from mcp_hostagent.requests.section import RequestsSection
from mcp_hostagent.telemetry.snapshot import (
    LATENCY_WINDOW_S, RECENT_REQUESTS, ProcRow, Snapshot, SnapshotBuilder, percentile, short_command,
)
from mcp_hostagent.pcie.episodes import link_degraded
from mcp_hostagent.core.timebase import Timebase

REPO = Path(__file__).resolve().parents[2]
WORKLOAD = REPO / "tests" / "workloads" / "marked_child.py"
AGENT = [sys.executable, "-m", "mcp_hostagent"]
S = 1_000_000_000
HOSTILE_ARG = b"\x1b]0;pwned\x07\x1b[2J\x1b[31m\xe2\x80\xaeevil\xff\xfe" + "漢字".encode() * 3 + b"A" * 3000


# --- helpers -------------------------------------------------------------------------------------


class Clock:
    def __init__(self, t: int = 1000 * S):
        self.t = t

    def __call__(self) -> int:
        return self.t


class Host:
    """Plain state behind the capabilities' own sections (each capability's section.py, made as its
    capability makes them): the per-process rows, kswapd and the storms, an NVML sampler and a sysfs
    reading of the GPUs' links, a NIC."""

    def __init__(self):
        self.proc_rows: dict = {}
        self.kswapd = KswapdTracker()
        self.storms: list[Episode] = []
        self.nvml = None  # gpuhealth.nvml.NvmlSampler
        self.pcie = None  # pcie.sysfs.PcieSnapshot
        self.nic = None  # the NIC capability as its section reads it (Nics below)

    def sections(self) -> list:
        links = (lambda: GpuHealth.links(SimpleNamespace(sampler=self.nvml))) if self.nvml else (lambda: {})
        return [RequestsSection(), ReclaimSection(self.kswapd, lambda: [e for e in self.storms if not e.closed]),
                CudaSection(), GpuSection(self.nvml), PcieSection(lambda: self.pcie, links),
                NicSection(self.nic if self.nic is not None else SimpleNamespace())]

    def builder(self, **kw) -> SnapshotBuilder:
        return SnapshotBuilder(self.sections(), **kw)


def request(pid: int, rid: int, begin_ns: int, dur_ms: float, faults: int = 10, reason: str = "marked",
            tid: int | None = None) -> FinishedRequest:
    return FinishedRequest(pid, tid or pid, rid, b"server\0\0", 0, begin_ns, begin_ns + int(dur_ms * 1e6), None,
                           "missing", reason, Counters(faults=faults, offcpu_ns=int(dur_ms * 1e5)))


def attrs(pid: int, cmd: str = "/usr/bin/python3 -m server", ctr: str | None = None) -> dict:
    a = {"process.pid": pid, "process.executable.name": cmd.split()[0].rsplit("/", 1)[-1],
         "process.command_line": cmd}
    if ctr:
        a["container.id"] = ctr
    return a


def no_control_chars(text: str) -> bool:
    return not any(unicodedata.category(c) in ("Cc", "Cf", "Cs") and c != "\n" for c in text)


def nvml_and_pcie(tmp_path, width: str | None = None):
    """The recorded H200 through the real NvmlSampler and PciePoller; width narrows the GPU's link."""
    sys.path.insert(0, str(Path(__file__).parent.parent))
    from nvml_replay import ReplayNvml
    from mcp_hostagent.gpuhealth.nvml import NvmlSampler
    from mcp_hostagent.pcie.sysfs import PciePoller

    fake = ReplayNvml()
    busy = next(i for i, r in enumerate(fake.samples) if r["phase"] == "busy")
    fake.next_sample = [busy]
    sampler = NvmlSampler(fake, slow_period_s=0)
    sampler.sample_once()
    with tarfile.open(Path(__file__).parent.parent / "fixtures" / "gpu" / "pci_sysfs.tar") as tf:
        tf.extractall(tmp_path / "sys", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    gpu = Path(os.path.realpath(tmp_path / "sys/bus/pci/devices/0000:00:06.0"))
    if width:
        (gpu / "current_link_width").write_text(width + "\n")
        (gpu / "aer_dev_correctable").write_text("RxErr 7\nBadTLP 2\nTOTAL_ERR_COR 9\n")
        (gpu / "aer_dev_nonfatal").write_text("DLP 0\nTOTAL_ERR_NONFATAL 0\n")
        (gpu / "aer_dev_fatal").write_text("DLP 0\nTOTAL_ERR_FATAL 0\n")
    return sampler, PciePoller(str(tmp_path / "sys")).poll()


def busy_snapshot(tmp_path=None, width: str | None = None) -> Snapshot:
    """Three ticks of a host with a marked server, a container, a hostile process, a storm and a GPU."""
    clock = Clock()
    host = Host()
    epoch = 1_700_000_000 * S
    if tmp_path is not None:
        host.nvml, host.pcie = nvml_and_pcie(tmp_path, width)
    b = host.builder(clock=clock, wall=lambda: epoch + clock.t, to_wall=lambda ns: epoch + ns)
    hostile = "\x1b]0;pwned\x07\x1b[2J\u202eevil\udcff" + "漢字" * 3 + "\u200b" + "A" * 3000
    rows = {
        101: (attrs(101), Counters()),
        202: (attrs(202, "/opt/app/worker --model llama", "ab" * 32), Counters()),
        303: ({"process.pid": 303, "process.executable.name": hostile, "process.command_line": hostile}, Counters()),
    }
    for tick in range(3):
        host.proc_rows = {pid: (a, Counters(faults=c.faults + 500 * tick * (pid // 100),
                                            offcpu_ns=c.offcpu_ns + tick * 250_000_000,
                                            offcpu_runnable_ns=tick * 70_000_000,  # of it, runnable
                                            cu_launch=tick * 1000 if pid == 202 else 0,
                                            cu_ctx_ops=tick * 100 if pid == 202 else 0,
                                            cu_ctx_ns=tick * 100 * 12_000 if pid == 202 else 0))
                          for pid, (a, c) in rows.items()}
        for i in range(20):
            b.on_request(request(101, tick * 100 + i, clock.t - S + i * 1_000_000, dur_ms=1 + i))
        if tick == 1:
            host.storms.append(Episode("host", clock.t - S // 2))
        b.on_tick(host.proc_rows)
        clock.t += S
    return b.latest()


# --- pure: rates, percentiles, the builder -------------------------------------------------------


def test_percentile_nearest_rank():
    vals = [float(v) for v in range(1, 101)]
    assert percentile(vals, 50) == 50 and percentile(vals, 99) == 99 and percentile(vals, 100) == 100
    assert percentile([7.0], 50) == percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0], 50) == 1.0 and percentile([1.0, 2.0], 99) == 2.0
    assert percentile([], 50) is None


def counter_rates(prev, cur, dt: float) -> dict:
    """A process row's rates as the capabilities' sections compute them (requests, reclaim, cuda)."""
    row = ProcRow(1, "srv", prev, cur, dt if prev is not None else 0.0)
    out: dict = {}
    for sec in (RequestsSection(), ReclaimSection(None, lambda: ()), CudaSection()):
        out.update(sec.process(row))
    return out


def test_counter_rates():
    prev = Counters(faults=1000, offcpu_ns=S, offcpu_runnable_ns=S // 10, cu_launch=10, cu_ctx_ops=5, cu_ctx_ns=50_000)
    cur = Counters(faults=1100, offcpu_ns=S + 500_000_000, offcpu_runnable_ns=S // 10 + 40_000_000, cu_launch=30, cu_launch_ptsz=4, cu_launch_ex=6,
                   cu_launch_ex_ptsz=2, cu_graph_launch=8, cu_ctx_ops=9, cu_ctx_ns=90_000, cu_sync_ns=4_000_000,
                   nv_ioctls=60, direct_reclaim_ns=3_000_000, memcg_reclaim_ns=1_000_000)
    r = counter_rates(prev, cur, 2.0)
    assert r == {"launches_per_s": 20.0, "ctx_switch_us": 10.0, "sync_ms_per_s": 2.0, "ioctls_per_s": 30.0,
                 "faults_per_s": 50.0, "reclaim_ms_per_s": 2.0, "offcpu_pct": 25.0, "wait_pct": 2.0}
    assert counter_rates(None, cur, 1.0) == {}  # first reading: no rate yet
    assert counter_rates(cur, prev, 1.0) == {}  # went backwards: pid reused
    assert counter_rates(prev, prev, 1.0)["ctx_switch_us"] is None  # no switch in the interval


def test_link_degraded_rule():
    assert link_degraded(5, 5, 16, 16, 90) is None
    assert link_degraded(1, 5, 16, 16, 0) is None  # idle Gen1: power saving
    assert link_degraded(1, 5, 16, 16, None) is None  # utilisation unknown
    assert link_degraded(4, 5, 16, 16, 80) == "Gen4 < Gen5 at 80% util"
    assert link_degraded(5, 5, 8, 16, 0) == "width x8 < x16"  # narrower: always
    # the pcie.busy_util_pct setting, as the spans' LinkJudge uses it
    assert link_degraded(4, 5, 16, 16, 30, busy_util_pct=50) is None
    assert link_degraded(4, 5, 16, 16, 60, busy_util_pct=50) == "Gen4 < Gen5 at 60% util"


def test_short_command():
    assert short_command("/usr/bin/python3 -m vllm serve") == "python3 -m vllm serve"
    assert short_command("'/opt/my app/server' --port 1") == "server --port 1"
    # argv[0] with control characters, as identity writes it: shlex-quoted, then escaped
    assert short_command("'/tmp/cu\\x1b[31mda\\u202edrv' x") == "'cu\\x1b[31mda\\u202edrv' x"
    assert short_command("'/tmp/unbalanced…") == "'/tmp/unbalanced…"  # cut by the length bound
    assert short_command("worker") == "worker"


def test_meminfo():
    m = parse_meminfo("MemTotal:       24683568 kB\nMemAvailable:   23000000 kB\nHugePages_Total:       0\n")
    assert m == {"MemTotal": 24683568 * 1024, "MemAvailable": 23000000 * 1024, "HugePages_Total": 0}


def test_builder_rates_latency_and_ring():
    clock = Clock()
    host = Host()
    b = host.builder(clock=clock, wall=lambda: clock.t, to_wall=lambda ns: ns)
    assert b.latest().seq == 0 and b.latest().processes == ()
    host.proc_rows = {42: (attrs(42), Counters(faults=100, offcpu_ns=0))}
    b.on_tick(host.proc_rows)
    first = b.latest().processes[0]
    assert first.faults_per_s is None and first.req_per_s is None and not first.marked
    clock.t += 2 * S
    for i in range(100):  # 1..100 ms, ended within the tick
        b.on_request(request(42, i + 1, clock.t - S, dur_ms=i + 1))
    host.proc_rows = {42: (attrs(42), Counters(faults=5100, offcpu_ns=S, offcpu_runnable_ns=S // 4))}
    b.on_tick(host.proc_rows)
    snap = b.latest()
    (p,) = snap.processes
    assert (p.pid, p.command, p.name) == (42, "python3 -m server", "python3")
    assert p.faults_per_s == 2500.0 and p.offcpu_pct == 50.0 and p.wait_pct == 12.5
    assert p.req_per_s == 50.0 and p.requests_total == 100 and p.marked
    assert p.p50_ms == 50.0 and p.p99_ms == 99.0
    reqs = snap.requests_of(42)
    assert len(reqs) == RECENT_REQUESTS  # bounded ring, newest first
    assert reqs[0].request_id == f"{100:016x}" and reqs[0].duration_ms == 100.0 and reqs[0].faults == 10
    # no request in the next tick: the rate drops to 0, the window still holds the latencies
    clock.t += S
    b.on_tick(host.proc_rows)
    p = b.latest().processes[0]
    assert p.req_per_s == 0.0 and p.p99_ms == 99.0 and p.faults_per_s == 0.0
    # past the latency window: no percentiles
    clock.t += int(LATENCY_WINDOW_S * S)
    b.on_tick(host.proc_rows)
    p = b.latest().processes[0]
    assert p.p50_ms is None and p.p99_ms is None and p.requests_total == 100


def test_builder_containers_findings_and_json_round_trip(tmp_path):
    snap = busy_snapshot()
    by_pid = {p.pid: p for p in snap.processes}
    assert by_pid[202].launches_per_s == 1000.0 and by_pid[202].ctx_switch_us == 12.0
    assert by_pid[202].container_id == "ab" * 32
    ctrs = {c.container_id: c for c in snap.containers}
    assert ctrs[None].processes == 2 and ctrs["ab" * 32].processes == 1
    assert ctrs[None].faults_per_s == by_pid[101].faults_per_s + by_pid[303].faults_per_s
    kinds = [f.kind for f in snap.findings]
    assert kinds[-1] == "reclaim_storm_open" and snap.host.storm and snap.host.storm_scopes == ("host",)
    assert snap.host.mem_total_bytes > 0 and snap.host.kswapd  # this machine's /proc and /sys
    back = Snapshot.from_json(snap.to_json())
    assert back == snap
    assert Snapshot.from_dict({**snap.to_dict(), "a_newer_field": 1}) == snap


def test_storm_close_and_ctx_heavy_findings():
    clock = Clock()
    host = Host()
    b = host.builder(clock=clock, wall=lambda: clock.t)
    ep = Episode("/kubepods/pod1\x1b[31m", clock.t)
    host.storms.append(ep)
    host.proc_rows = {7: (attrs(7), Counters())}
    b.on_tick(host.proc_rows)
    clock.t += S
    ep.closed, ep.end_ns, ep.peak_direct_ms_per_s = True, clock.t, 42.0
    cuda_proc = attrs(7, "/opt/\x1b[2Jgpu\u202eworker --x")  # a CUDA process with a hostile name
    host.proc_rows = {7: (cuda_proc, Counters(cu_ctx_ops=8000, cu_ctx_ns=8000 * 10_000))}  # 80 ms/s
    b.on_tick(host.proc_rows)
    f = b.latest().findings
    assert [x.kind for x in f] == ["ctx_switch_heavy", "reclaim_storm_close", "reclaim_storm_open"]
    assert "\x1b" not in f[1].text and "\\x1b[31m" in f[1].text and "peak direct 42 ms/s" in f[1].text
    assert f[0].text == "CUDA context switches heavy: pid 7 (\\x1b[2Jgpu\\u202eworker --x) 80 ms/s, 10.0 us each"
    assert no_control_chars(f[0].text)
    clock.t += S
    host.proc_rows = {7: (attrs(7), Counters(cu_ctx_ops=9000, cu_ctx_ns=9000 * 10_000))}  # 10 ms/s: cleared
    b.on_tick(host.proc_rows)
    clock.t += S
    host.proc_rows = {7: (attrs(7), Counters(cu_ctx_ops=17000, cu_ctx_ns=17000 * 10_000))}  # heavy again
    b.on_tick(host.proc_rows)
    assert [x.kind for x in b.latest().findings].count("ctx_switch_heavy") == 2


class Nics:
    """The NIC capability as the builder reads it: the drained LinkEvents (a bounded deque) and the
    watcher's current links."""

    def __init__(self, maxlen: int = 256):
        from mcp_hostagent.core.capability import SourceStatus

        self.nic_events = deque(maxlen=maxlen)
        self.states: dict = {}
        self.nics = SimpleNamespace(links=lambda: dict(self.states))
        self.sources = {"nic_netlink": SourceStatus("nic_netlink", "attached")}

    def link(self, name, admin=True, carrier=True, oper="UP", speed=10000):
        self.states[name] = NicState(name, len(self.states) + 2, admin, carrier, oper, speed if carrier else None)

    def event(self, t_ns, name, kind, carrier=None, oper=None, speed=None, prev=None, flaps=0):
        self.nic_events.append(LinkEvent(t_ns, name, 2, kind, carrier, oper, speed, prev, flaps))


def test_nic_link_events_become_findings_and_json(tmp_path):
    clock = Clock()
    host = Host()
    host.nic = nics = Nics(maxlen=8)
    b = host.builder(clock=clock, wall=lambda: clock.t, to_wall=lambda ns: ns)
    hostile = "\x1b[7m\u202eq"  # a valid interface name: the kernel refuses only / : and white space
    for name in ("eth0", "vA", hostile):
        nics.link(name)
    b.on_tick(host.proc_rows)
    assert [n.name for n in b.latest().host.nics] == ["\\x1b[7m\\u202eq", "eth0", "vA"]  # by raw name
    assert b.latest().host.nic == "ok" and b.latest().findings == ()
    clock.t += S
    t_down = clock.t - S // 2
    nics.event(t_down, "vA", "admin_down", False, "DOWN")  # one netlink message: set down, carrier gone
    nics.event(t_down, "vA", "carrier_down", False, "DOWN", prev=10000)
    nics.event(t_down + 1000, hostile, "carrier_down", False, "LOWERLAYERDOWN", prev=10000)
    nics.link("vA", admin=False, carrier=False, oper="DOWN")
    nics.link(hostile, carrier=False, oper="LOWERLAYERDOWN")
    b.on_tick(host.proc_rows)
    snap = b.latest()
    assert [(f.kind, f.subject, f.text) for f in snap.findings] == [
        ("nic_carrier_down", "\\x1b[7m\\u202eq", "NIC \\x1b[7m\\u202eq carrier down, operstate LOWERLAYERDOWN"),
        ("nic_carrier_down", "vA", "NIC vA carrier down (set down), operstate DOWN")]
    down = {n.name: n.down_since_wall_ns for n in snap.host.nics}
    assert down == {"eth0": None, "vA": t_down, "\\x1b[7m\\u202eq": t_down + 1000}
    for w, h in ((80, 24), (120, 30), (20, 5)):
        check_frame(render(snap, w, h, ViewState()), w, h)
    text = [line_text(ln) for ln in render(snap, 80, 24, ViewState())]
    assert "NIC DOWN \\x1b[7m\\u202eq,vA" in text[2]
    assert any(t.rstrip().endswith(" NIC vA carrier down (set down), operstate DOWN") for t in text)
    back = Snapshot.from_json(snap.to_json())
    assert back == snap and isinstance(back.host.nics[0], type(snap.host.nics[0]))
    # both back (one flap each); a new interface coming up is not a finding
    clock.t += S
    nics.event(clock.t - 10, "vA", "admin_up", False, "DOWN")
    nics.event(clock.t - 5, "vA", "carrier_up", True, "UP", 10000, flaps=1)
    nics.event(clock.t - 4, hostile, "carrier_up", True, "UP", 10000, flaps=1)
    nics.event(clock.t - 3, "veth9", "admin_up", False, "DOWN")
    nics.event(clock.t - 2, "veth9", "carrier_up", True, "UP", 10000)
    for name in ("vA", hostile, "veth9"):
        nics.link(name)
    b.on_tick(host.proc_rows)
    snap = b.latest()
    assert [(f.kind, f.subject) for f in snap.findings[:2]] == [("nic_carrier_up", "\\x1b[7m\\u202eq"),
                                                               ("nic_carrier_up", "vA")]
    down_s = (clock.t - 5 - t_down) / 1e9
    assert snap.findings[1].text == f"NIC vA carrier up at 10000 Mb/s after {down_s:.1f}s; 1 flap in 60s"
    assert len(snap.findings) == 4
    assert {n.name: (n.flaps, n.down_since_wall_ns) for n in snap.host.nics}["vA"] == (1, None)
    assert "NIC DOWN" not in line_text(render(snap, 80, 24, ViewState())[2])
    lines = render(snap, 120, 30, ViewState())
    up = next(ln for ln in lines if "NIC vA carrier up" in line_text(ln))
    assert up[-2][1] == "ok"  # a comeback is good news; losses are warnings
    # more events than the deque holds between two ticks: each seen once, none twice
    clock.t += S
    for i in range(2, 8):
        nics.event(clock.t - 100 + 2 * i, "vA", "carrier_down", False, "DOWN", prev=10000)
        nics.event(clock.t - 99 + 2 * i, "vA", "carrier_up", True, "UP", 10000, flaps=i)
    b.on_tick(host.proc_rows)
    kinds = [f.kind for f in b.latest().findings]
    assert kinds[:8] == ["nic_flapping", "nic_carrier_down"] * 4 and kinds[8] == "nic_carrier_up"
    assert b.latest().findings[0].text.startswith("NIC vA flapping: carrier up at 10000 Mb/s after 0.0s; 7 flaps")
    n = len(b.latest().findings)
    clock.t += S
    nics.event(clock.t - 1, "vA", "speed_change", True, "UP", 1000, prev=10000)
    b.on_tick(host.proc_rows)
    f = b.latest().findings
    assert len(f) == n + 1 and (f[0].kind, f[0].text) == ("nic_speed_down", "NIC vA speed 10000 -> 1000 Mb/s")
    clock.t += S
    b.on_tick(host.proc_rows)  # nothing new
    assert len(b.latest().findings) == n + 1
    # comebacks seen in the last 60 s: 1 + the 4 of the 6 that were still in the deque
    assert {n.name: n.flaps for n in b.latest().host.nics}["vA"] == 5
    clock.t += 61 * S
    b.on_tick(host.proc_rows)
    assert {n.name: n.flaps for n in b.latest().host.nics}["vA"] == 0


def test_gpu_header_from_recorded_h200(tmp_path):
    snap = busy_snapshot(tmp_path)
    (g,) = snap.host.gpus
    assert g.bus_id == "0000:00:06.0" and g.up and g.util_pct and g.util_pct > 10
    assert (g.link_gen, g.link_width, g.link_gen_max, g.link_width_max) == (5, 16, 5, 16)
    assert not g.link_degraded and g.mem_total_bytes > 140e9 and snap.host.nvml == "ok"
    assert g.aer_correctable is None  # no AER files in the recorded tree


def test_narrower_link_is_degraded_and_found(tmp_path):
    snap = busy_snapshot(tmp_path, width="8")
    (g,) = snap.host.gpus
    assert g.link_degraded and g.link_width == 8 and g.link_why == "width x8 < x16"
    assert (g.aer_correctable, g.aer_nonfatal, g.aer_fatal) == (9, 0, 0)
    (f,) = [f for f in snap.findings if f.kind == "link_degraded"]
    assert "0000:00:06.0" in f.text and "Gen5 x8 of Gen5 x16" in f.text
    frame = render(snap, 120, 30, ViewState())
    line = next(ln for ln in frame if line_text(ln).startswith("GPU0"))
    assert ("Gen5x8/Gen5x16 DEGRADED", "warn") in line
    assert "AER 9/0/0" in line_text(line)


# --- pure: the renderer and the keys -------------------------------------------------------------


def check_frame(lines, width, height):
    assert len(lines) == height
    for ln in lines:
        text = line_text(ln)
        assert cells(text) == width, (cells(text), text)
        assert no_control_chars(text), repr(text)


def test_frame_80x24(tmp_path):
    snap = busy_snapshot(tmp_path)
    st = ViewState()
    lines = render(snap, 80, 24, st)
    check_frame(lines, 80, 24)
    text = [line_text(ln) for ln in lines]
    (Path(tmp_path) / "frame80.txt").write_text("\n".join(text))
    assert text[0].startswith("mcp-agent top - ") and "local probes" in text[0]
    assert text[1].startswith("Mem ") and "PSI mem some" in text[1]
    assert text[2].startswith("kswapd n0:") and "storm: STORM host" in text[2]
    assert text[3].startswith("GPU0 ") and "Gen5x16/Gen5x16" in text[3]
    head = text[4]
    for title in ("PID", "COMMAND", "GPU", "▼REQ/s", "P50ms", "P99ms", "FLT/s", "WAIT%", "LNCH/s", "RCLMms/s"):
        assert title in head
    for title in ("CONTAINER", "IOCTL/s", "SYNCms/s", "CTXus"):
        assert title not in head  # no room at 80 columns
    assert [t.split()[0] for t in text[5:8]] == ["101", "202", "303"]  # by requests/s, then pid
    assert any(t.startswith("FINDINGS (newest first)") for t in text)
    assert any(re.match(r"\d\d:\d\d:\d\d reclaim storm opened: host", t) for t in text)
    assert text[-1].startswith("q quit  h help")


def test_frame_200x50(tmp_path):
    snap = busy_snapshot(tmp_path)
    lines = render(snap, 200, 50, ViewState())
    check_frame(lines, 200, 50)
    text = [line_text(ln) for ln in lines]
    head = next(t for t in text if t.lstrip().startswith("PID"))
    titles = head.split()
    assert titles == ["PID", "COMMAND", "CONTAINER", "GPU", "▼REQ/s", "P50ms", "P99ms", "LNCH/s", "CTXus",
                      "SYNCms/s", "IOCTL/s", "FLT/s", "RCLMms/s", "WAIT%"]
    row = next(t for t in text if t.split()[:1] == ["202"])
    cells = row.split()
    assert cells[1:4] == ["worker", "--model", "llama"] and cells[4] == "abababababab"
    # LNCH/s CTXus SYNC IOCTL FLT RCLM WAIT%: the runnable share of the 25% off-CPU, not the 25%
    assert cells[-7:] == ["1000", "12", "0", "0", "1000", "0", "7"]
    assert next(p for p in snap.processes if p.pid == 202).offcpu_pct == 25.0  # the total stays in --json


def test_hostile_names_are_escaped_and_cut(tmp_path):
    snap = busy_snapshot()
    for w, h in ((80, 24), (200, 50), (20, 5)):
        lines = render(snap, w, h, ViewState())
        check_frame(lines, w, h)
    st = ViewState(filter="pwned")
    lines = render(snap, 200, 30, st)
    check_frame(lines, 200, 30)
    row = next(line_text(ln) for ln in lines if line_text(ln).lstrip().startswith("303"))
    assert "\\x1b]0;pwned\\x07\\x1b[2J\\u202eevil\\xff漢字漢字漢字\\u200bAAA" in row and "AAA… " in row
    # expanded: the whole (bounded) command line on one line, still escaped
    st.expanded = 303
    lines = render(snap, 120, 30, st)
    check_frame(lines, 120, 30)
    # wide characters are cut by cells, never half a character
    assert fit("漢字漢字", 5) == "漢字…" and cells(fit("漢字漢字", 4)) == 4
    assert fit("a\u200bb", 10).startswith("a\\u200bb")
    # --once text with colour off: no escape at all; with colour: only our SGR codes
    plain = frame_text(render(snap, 80, None, ViewState()), colour=False)
    assert "\x1b" not in plain
    coloured = frame_text(render(snap, 80, None, ViewState()), colour=True)
    assert set(re.findall(r"\x1b\[[0-9;]*m", coloured)) <= {"\x1b[1m", "\x1b[7m", "\x1b[1;31m", "\x1b[2m",
                                                              "\x1b[32m", "\x1b[0m"}
    assert "\x1b]" not in coloured and "\x1b[2J" not in coloured


def test_ascii_terminal():
    snap = busy_snapshot()
    out = frame_text(render(snap, 80, 24, ViewState()), False,
                         SimpleNamespace(encoding="ascii"))
    out.encode("ascii")
    assert "vREQ/s" in out


def test_keys():
    snap = busy_snapshot()
    st = ViewState()
    render(snap, 80, 24, st)
    assert st.visible_cols[:2] == ("pid", "command")
    handle_key(st, ">")
    assert st.sort == "p50" and st.descending
    for _ in range(3):
        handle_key(st, "<")
    assert st.sort == "command" and not st.descending
    handle_key(st, "1")
    assert st.sort == "pid" and not st.descending
    handle_key(st, "1")
    assert st.descending  # the same column again: reversed
    rows = sorted_rows(snap, st)
    assert [p.pid for p in rows] == [303, 202, 101]
    handle_key(st, "r")
    assert [p.pid for p in sorted_rows(snap, st)] == [101, 202, 303]
    for k in "/work":
        handle_key(st, k)
    assert st.editing and st.filter == "work"
    render(snap, 80, 24, st)
    assert [p.pid for p in st.rows] == [202]
    handle_key(st, KEY_ENTER)
    assert not st.editing and st.filter == "work"
    handle_key(st, "/")
    handle_key(st, "x")
    handle_key(st, KEY_ESC)
    assert st.filter == "" and not st.editing
    render(snap, 80, 24, st)
    handle_key(st, KEY_DOWN)
    assert st.selected_pid == 202
    handle_key(st, "e")
    assert st.expanded == 202
    text = [line_text(ln) for ln in render(snap, 80, 24, st)]
    assert text[4].startswith("PID 202 worker")
    handle_key(st, KEY_ESC)
    assert st.expanded is None
    handle_key(st, "p")
    assert st.paused and "PAUSED" in line_text(render(snap, 80, 24, st)[0])
    handle_key(st, "?")
    text = [line_text(ln) for ln in render(snap, 80, 24, st)]
    assert "keys" in text[4] and any("sort by the column" in t for t in text)
    handle_key(st, "c")
    assert st.containers
    st.help = False
    text = [line_text(ln) for ln in render(snap, 80, 24, st)]
    assert any("2 processes" in t for t in text)
    handle_key(st, "q")
    assert st.quit


# --- the control socket, without BPF -------------------------------------------------------------


def test_control_socket_serves_snapshots(tmp_path):
    snap_b = Host().builder()
    snap_b.on_tick({})
    path = str(tmp_path / "run" / "agent.sock")
    srv = control.ControlServer(snap_b, path)
    srv.start()
    try:
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
        assert control.agent_answers(path)
        snap = control.fetch_snapshot(path)
        assert snap.source == "socket" and snap.seq == 1
        c = control.ControlClient(path)
        assert c.ping()["pid"] == os.getpid()
        assert c.snapshot().seq == 1  # the same connection, twice
        c.close()
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            s.sendall(b"{nope\nsnapshot\nfrobnicate\n")
            f = s.makefile("rb")
            assert json.loads(f.readline()) == {"error": "bad JSON"}
            assert json.loads(f.readline())["seq"] == 1
            assert json.loads(f.readline())["error"] == "unknown op"
        with socket.socket(socket.AF_UNIX) as s:  # a request line without end is bounded
            s.connect(path)
            s.sendall(b"x" * 10000)
            assert b"too long" in s.makefile("rb").readline()
        with pytest.raises(control.ControlError, match="already serves"):
            control.ControlServer(snap_b, path).start()
    finally:
        srv.stop()
    assert not os.path.exists(path)
    with pytest.raises(control.ControlError, match="no agent socket"):
        control.fetch_snapshot(path)


def test_control_socket_replaces_stale_and_refuses_files(tmp_path):
    path = str(tmp_path / "agent.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()  # a socket file nobody listens on: an agent that was killed
    with pytest.raises(control.ControlError, match="stale"):
        control.fetch_snapshot(path)
    srv = control.ControlServer(SnapshotBuilder(), path)
    srv.start()
    assert control.agent_answers(path)
    srv.stop()
    Path(path).write_text("not a socket")
    with pytest.raises(control.ControlError, match="not a socket"):
        control.ControlServer(SnapshotBuilder(), path).start()
    assert Path(path).read_text() == "not a socket"


def test_cli_errors_are_one_line(tmp_path):
    """No agent on an explicit --socket: that error. The configured one unreachable, as nobody: the
    socket's error and the need for root. One line, exit 1."""
    env = env_for(str(tmp_path / "none.sock"))
    r = subprocess.run([*AGENT, "top", "--socket", str(tmp_path / "other.sock")], env=env, capture_output=True,
                       text=True, timeout=30)
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == f"mcp-agent: error: no agent socket at {tmp_path / 'other.sock'} (is `mcp-agent run` running?)\n"
    # nobody cannot reach pytest's tmp_path (mode 0700): the socket's own error comes first
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *AGENT, "top", "--once"],
                       env=env, capture_output=True, text=True, timeout=30)
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr.splitlines() == [f"mcp-agent: error: permission denied on {tmp_path / 'none.sock'}; HINT: run as "
                                     "root or as a member of its group; starting the probes here needs root; HINT: "
                                     "sudo mcp-agent top, or start `mcp-agent run`"]


# --- the real thing ------------------------------------------------------------------------------


class MarkedChild:
    """tests/workloads/marked_child.py, driven by a thread: requests that touch fresh pages."""

    def __init__(self, pages: int = 64, args: tuple[bytes, ...] = ()):
        argv = [sys.executable.encode(), str(WORKLOAD).encode(), *args]  # the workload ignores its arguments
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.pid = self.p.pid
        self.pages = pages
        self.ended = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def do(self, cmd: str) -> None:
        self.p.stdin.write(cmd.encode() + b"\n")
        assert self.p.stdout.readline().strip() == b"ok", cmd

    def _run(self):
        i = 0
        while not self._stop.is_set():
            i += 1
            self.do(f"begin {i}")
            self.do(f"touch {self.pages}")
            self.do("spin 2")
            self.do(f"end {i}")
            self.ended = i
            time.sleep(0.01)

    def start(self):
        self._t.start()
        return self

    def close(self):
        self._stop.set()
        self._t.join(5)
        if self.p.poll() is None:
            try:
                self.p.stdin.write(b"exit\n")
                self.p.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait(5)


HOSTILE_DRIVER = "cu\x1b[31mda\u202edrv"  # the cuda_driver binary under this name: 15 bytes, its whole comm
FAKE_DEV = f"/dev/shm/mcp-fake-nvidia-top{os.getpid()}"  # an NVIDIA device file, by cuda.device_globs


def build_cuda(d: Path) -> SimpleNamespace:
    """tests/c/fake_libcuda.c as libcuda.so.1 and tests/c/cuda_driver.c under a hostile name (as
    test_bpf_cuda builds them)."""
    from mcp_hostagent.core.records import bpf_source_dir

    src = Path(__file__).parent.parent / "c"
    d.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cc", "-O2", "-Wall", "-Werror", "-shared", "-fPIC", "-fno-ipa-icf", "-o", str(d / "libcuda.so.1"),
                    str(src / "fake_libcuda.c"), "-lpthread"], check=True)
    drv = d / HOSTILE_DRIVER
    subprocess.run(["cc", "-O2", "-Wall", "-Werror", f"-I{bpf_source_dir()}", "-o", str(drv),
                    str(src / "cuda_driver.c"), "-ldl", "-lpthread"], check=True)
    return SimpleNamespace(dir=d, lib=str(d / "libcuda.so.1"), drv=str(drv))


class CudaLoad:
    """The cuda_driver on the fake libcuda, driven at a steady 20 rounds a second; each round 40 launches
    (cuLaunchKernel, _ptsz, Ex, Ex_ptsz), 5 context pushes and 5 pops, 2 stream syncs of 2 ms, 20 ioctls
    on an NVIDIA device file. After each round it asks the library for its call counters: the truth."""

    ROUND_S = 0.05
    SYNC_NS = 2_000_000

    def __init__(self, build):
        sys.path.insert(0, str(Path(__file__).parent.parent))
        from test_bpf_cuda import Driver

        self.drv = Driver(build, build.lib)
        self.pid = self.drv.pid
        self.fd = int(self.drv.do(f"open {FAKE_DEV}")[0])
        self.drv.do(f"syncns {self.SYNC_NS}")
        self.samples: list[tuple[float, list[int], int]] = []  # (monotonic, library call counters, ioctls)
        self.ioctls = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        next_at = time.monotonic()
        while not self._stop.is_set():
            for cmd in ("launch 10", "sym cuCtxPushCurrent_v2 5", "sym cuCtxPopCurrent_v2 5",
                        "sym cuStreamSynchronize 2", f"ioctl {self.fd} 20 0x30"):
                self.drv.do(cmd)
            self.ioctls += 20
            self.samples.append((time.monotonic(), [int(x) for x in self.drv.do("calls")], self.ioctls))
            next_at = max(next_at + self.ROUND_S, time.monotonic())  # behind: skip, do not burst
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def rates(self, t0: float, t1: float) -> dict:
        """What the library counted between two moments, per second (the sync figure from the calls
        made and the wait each was told to take: a lower bound of the real wait)."""
        a = next(x for x in self.samples if x[0] >= t0)
        b = [x for x in self.samples if x[0] <= t1][-1]
        dt = b[0] - a[0]
        calls = [y - x for x, y in zip(a[1], b[1])]
        return {"launch": sum(calls[0:6]) / dt, "ctx_ops": sum(calls[6:11]) / dt,
                "sync": (calls[11] + calls[12] + calls[13] + calls[14]) * self.SYNC_NS / 1e6 / dt,
                "ioctl": (b[2] - a[2]) / dt}

    def close(self):
        self._stop.set()
        self._t.join(5)
        self.drv.close()
        if os.path.exists(FAKE_DEV):
            os.unlink(FAKE_DEV)


def env_for(sock: str, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MCP_AGENT_", "OTEL_"))}
    env.update({"MCP_AGENT_CONFIG": os.devnull, "MCP_AGENT_CONTROL_SOCKET": sock}, **extra)
    return env


class Tmux:
    """A detached tmux session running cmd. Its exit status goes to a file: tmux 3.3 at times leaves
    a pane's process unreaped (pane dead, no #{pane_dead_status}) on this busy VM."""

    def __init__(self, cmd: str, env: dict, width: int = 120, height: int = 40):
        self.name = f"mcptop{os.getpid()}"
        self.base = ["tmux", "-L", self.name]
        self.status_path = Path(tempfile.gettempdir()) / f"{self.name}.status"
        self.status_path.unlink(missing_ok=True)
        envs = [a for k, v in env.items() if k.startswith(("MCP_AGENT_", "NO_COLOR")) for a in ("-e", f"{k}={v}")]
        subprocess.run([*self.base, "-f", os.devnull, "new-session", "-d", "-x", str(width), "-y", str(height),
                        "-s", "top", *envs, f"{cmd}; echo $? > {self.status_path}.tmp && mv {self.status_path}.tmp "
                        f"{self.status_path}"], check=True, env=env, cwd=REPO)
        subprocess.run([*self.base, "set-option", "-t", "top", "remain-on-exit", "on"], check=True)

    def exit_status(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while not self.status_path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return int(self.status_path.read_text()) if self.status_path.exists() else None

    def keys(self, *keys: str) -> None:
        subprocess.run([*self.base, "send-keys", "-t", "top", *keys], check=True)

    def screen(self, escapes: bool = False) -> str:
        return subprocess.run([*self.base, "capture-pane", "-p", *(["-e"] if escapes else []), "-t", "top"],
                              check=True, capture_output=True, text=True).stdout

    def wait(self, pred, timeout: float = 10.0, what: str = "") -> str:
        deadline = time.monotonic() + timeout
        while True:
            s = self.screen()
            if pred(s):
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"screen never showed {what}:\n{s}")
            time.sleep(0.15)

    def pane(self, fmt: str) -> str:
        return subprocess.run([*self.base, "display-message", "-p", "-t", "top", fmt], check=True,
                              capture_output=True, text=True).stdout.strip()

    def kill(self):
        subprocess.run([*self.base, "kill-server"], capture_output=True)
        self.status_path.unlink(missing_ok=True)


def colour_codes(text: str) -> set[int]:
    """SGR parameters that set a colour (30-38, 40-48, 90-97, 100-107; 39/49 are the defaults)."""
    found = set()
    for params in re.findall(r"\x1b\[([0-9;:]*)m", text):
        for p in filter(None, re.split("[;:]", params)):
            n = int(p)
            if 30 <= n <= 38 or 40 <= n <= 48 or 90 <= n <= 97 or 100 <= n <= 107:
                found.add(n)
    return found


def row_of(screen: str, pid: int, cols: list[str]) -> dict | None:
    for line in screen.splitlines():
        tok = line.split()
        if tok[:1] == [str(pid)] and len(tok) >= len(cols):
            # COMMAND may hold spaces: numbers are taken from the right
            right = cols[cols.index("command") + 1:]
            return dict(zip(right, tok[len(tok) - len(right):]))
    return None


def num(text: str) -> float:
    m = {"k": 1e3, "M": 1e6, "G": 1e9}
    return float(text[:-1]) * m[text[-1]] if text[-1] in m else (0.0 if text == "-" else float(text))


@pytest.mark.bpf
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_top_in_tmux_as_a_person_uses_it(tmp_path):
    cuda = build_cuda(tmp_path / "cuda")
    child = MarkedChild().start()
    load = CudaLoad(cuda)
    # budget 1: launches counted exactly. The governor would duty-cycle them on a busy VM, where one
    # hit costs more, and a 0.5 s tick could fall in an off-slice (test_bpf_cuda tests it on its own)
    env = env_for(str(tmp_path / "no-agent.sock"), NO_COLOR="1", MCP_AGENT_CUDA_OVERHEAD_BUDGET="1.0",
                  MCP_AGENT_CUDA_DEVICE_GLOBS="/dev/nvidia*,/dev/shm/mcp-fake-nvidia*")
    tm = None
    try:
        tm = Tmux(f"{sys.executable} -m mcp_hostagent top --interval 0.5", env)
        cols = list(layout(120)[0])
        keys = [c.key for c in cols]
        assert keys[:2] == ["pid", "command"] and "faults" in keys and "req" in keys

        def live(s):
            r = row_of(s, child.pid, keys)
            return r is not None and num(r["req"]) > 0 and num(r["faults"]) >= 64

        s = tm.wait(live, 60, f"pid {child.pid} with requests/s and faults/s")  # BPF compiles on a busy 2-CPU VM
        assert "local probes" in s.splitlines()[0] and "▼REQ/s" in s
        assert next(ln for ln in s.splitlines() if ln.split()[:1] == [str(child.pid)]).split()[1] == "python"
        assert not colour_codes(tm.screen(escapes=True))  # NO_COLOR: bold and reverse only
        # sorting: next column, then the first (PID, ascending)
        tm.keys(">")
        tm.wait(lambda s: "▼P50ms" in s and "▼REQ/s" not in s, 5, "sort by P50")
        tm.keys("1")
        tm.wait(lambda s: "▲PID" in s, 5, "sort by PID")
        # the CUDA driver on the fake libcuda: launches, context switches, sync wait and NVIDIA ioctls
        cuda_cols = ("launch", "ctx", "sync", "ioctl")

        def cuda_live(s):
            r = row_of(s, load.pid, keys)
            return r is not None and all(num(r[k]) > 0 for k in cuda_cols)

        tm.wait(cuda_live, 30, f"pid {load.pid} with CUDA figures")
        t0, shown = time.monotonic(), []
        while len(shown) < 6:  # one tick is 0.5 s here: several, against the library's count over them all
            time.sleep(0.5)
            r = row_of(tm.wait(lambda s: row_of(s, load.pid, keys), 5, "the driver's row"), load.pid, keys)
            shown.append({k: num(r[k]) for k in cuda_cols})
        truth = load.rates(t0 - 0.5, time.monotonic())
        seen = {k: sorted(x[k] for x in shown)[len(shown) // 2] for k in cuda_cols}  # medians
        assert 0.6 * truth["launch"] <= seen["launch"] <= 1.5 * truth["launch"], (seen, truth, shown)
        assert 0.6 * truth["ioctl"] <= seen["ioctl"] <= 1.5 * truth["ioctl"], (seen, truth, shown)
        # waits of 2 ms that a shared VM stretches by its wake-up latency
        assert 0.8 * truth["sync"] <= seen["sync"] <= 2.5 * truth["sync"], (seen, truth, shown)
        # the fake push/pop return at once: their time is the uprobe pair's, microseconds
        assert truth["ctx_ops"] > 0 and 0 < seen["ctx"] < 1000, (seen, truth, shown)
        line = next(ln for ln in tm.screen().splitlines() if ln.split()[:1] == [str(load.pid)])
        assert line.split()[1].startswith("'cu\\x1b[31mda\\u2")  # the hostile name, escaped
        assert not colour_codes(tm.screen(escapes=True))  # and its colour code not sent to the terminal
        # sort by LNCH/s with its column number: the driver first, every row in order
        def by_launches(s):
            return [(int(ln.split()[0]), num(row_of(ln, int(ln.split()[0]), keys)["launch"]))
                    for ln in s.splitlines() if re.match(r"\s*\d+ ", ln) and row_of(ln, int(ln.split()[0]), keys)]

        def sorted_by_launches(s):
            order = by_launches(s)
            pids = [p for p, _ in order]
            return ("▼LNCH/s" in s and load.pid in pids and child.pid in pids
                    and [v for _, v in order] == sorted((v for _, v in order), reverse=True))

        tm.keys(str(keys.index("launch") + 1))
        # waited for, not read once: a capture can catch curses halfway through redrawing the rows
        s = tm.wait(sorted_by_launches, 5, "rows sorted by LNCH/s")
        pids = [p for p, _ in by_launches(s)]
        assert pids.index(load.pid) < pids.index(child.pid) and dict(by_launches(s))[load.pid] > 0, by_launches(s)
        # filtering: `/`, a name, Enter
        tm.keys("/", "marked_child", "Enter")
        s = tm.wait(lambda s: "filter: marked_child" in s and row_of(s, child.pid, keys), 5, "the filter")
        tm.keys("/", "no-such-process", "Enter")
        tm.wait(lambda s: "no process matches filter 'no-such-process'" in s, 5, "an empty filter result")
        tm.keys("/", "marked_child", "Enter")
        tm.wait(lambda s: row_of(s, child.pid, keys), 5, "the row back")
        # expand the (only, selected) process: its recent request spans
        tm.keys("Enter")
        def span_rows(s):
            return [ln.split() for ln in s.splitlines() if re.match(r"\d\d:\d\d:\d\d [0-9a-f]{16} ", ln)]

        def spans_shown(s):  # each its pid's, ended by its marker, with the faults of 64 touched pages
            rows = span_rows(s)
            try:
                return (f"PID {child.pid} " in s and rows and all(sp[2] == str(child.pid) and sp[-1] == "marked"
                                                                    and num(sp[4]) >= 64 for sp in rows))
            except (IndexError, ValueError):  # a row half drawn
                return False

        # waited for like the sort above: a capture once caught a span row half drawn (CI, 898f6da)
        s = tm.wait(spans_shown, 5, f"the spans, each of pid {child.pid}, marked, with >= 64 faults")
        assert f"cmd: {sys.executable} {WORKLOAD}" in s
        tm.keys("Escape")
        tm.wait(lambda s: row_of(s, child.pid, keys), 5, "the table again")
        # help, and out of it
        tm.keys("h")
        tm.wait(lambda s: "sort by the column left / right" in s, 5, "the help")
        tm.keys("h")
        tm.wait(lambda s: "sort by the column left / right" not in s and "FINDINGS" in s, 5, "help closed")
        # pause: the clock in the title stops
        tm.keys("p")
        s1 = tm.wait(lambda s: "PAUSED" in s, 5, "PAUSED")
        time.sleep(1.2)
        assert tm.screen().splitlines()[0] == s1.splitlines()[0]
        tm.keys("p")
        tm.keys("q")
        # detaching the CUDA uprobes takes seconds on a busy host; top waits up to LOCAL_STOP_S
        assert tm.exit_status(LOCAL_STOP_S + 10) == 0, tm.screen()
    finally:
        if tm is not None:
            tm.kill()
        child.close()
        load.close()


def listening_tcp_inodes() -> set[str]:
    out = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            f = ln.split()
            if f[3] == "0A":  # TCP_LISTEN
                out.add(f[9])
    return out


@pytest.mark.bpf
def test_top_attaches_to_a_running_agents_socket(tmp_path):
    sock = str(tmp_path / "run" / "agent.sock")
    env = env_for(sock)
    err = open(tmp_path / "run.err", "w+")
    agent = subprocess.Popen([*AGENT, "run", "--jsonl", "none", "--no-status"], env=env, stdout=subprocess.DEVNULL,
                             stderr=err)
    child = tm = None
    try:
        deadline = time.monotonic() + 20
        while not control.agent_answers(sock) and time.monotonic() < deadline:
            assert agent.poll() is None, Path(err.name).read_text()
            time.sleep(0.1)
        assert control.agent_answers(sock), Path(err.name).read_text()
        assert f"control:  {sock} (mode 0660" in Path(err.name).read_text()
        st = os.stat(sock)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
        # no TCP listener: none of the agent's sockets is a listening TCP socket
        inodes = set()
        for fd in os.listdir(f"/proc/{agent.pid}/fd"):
            try:
                target = os.readlink(f"/proc/{agent.pid}/fd/{fd}")
            except FileNotFoundError:  # closed meanwhile
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
        assert inodes and not inodes & listening_tcp_inodes()
        child = MarkedChild().start()
        deadline = time.monotonic() + 10
        while True:
            r = subprocess.run([*AGENT, "top", "--json"], env=env, capture_output=True, text=True, timeout=20)
            assert r.returncode == 0, r.stderr
            snap = json.loads(r.stdout)
            assert snap["source"] == "socket"
            procs = {p["pid"]: p for p in snap["processes"]}
            p = procs.get(child.pid)
            if p and p["req_per_s"] and p["faults_per_s"] or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert p is not None, snap["processes"]
        assert p["marked"] and p["req_per_s"] > 0 and p["faults_per_s"] >= 64 and p["p99_ms"] >= 2
        assert "marked_child.py" in p["command"]
        reqs = [q for q in snap["requests"] if q["pid"] == child.pid]
        assert reqs and all(q["faults"] >= 64 and q["end_reason"] == "marked" for q in reqs)
        r = subprocess.run([*AGENT, "top", "--once"], env={**env, "COLUMNS": "100"}, capture_output=True,
                           text=True, timeout=20)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert "attached to agent socket" in lines[0] and "\x1b" not in r.stdout
        assert any(ln.split()[:1] == [str(child.pid)] for ln in lines)
        assert all(cells(ln) <= 100 for ln in lines)
        # interactive, attached, in colour (no NO_COLOR, a terminal): then q
        tm = Tmux(f"{sys.executable} -m mcp_hostagent top", env, width=100, height=30)
        s = tm.wait(lambda s: "attached to agent socket" in s and row_of(s, child.pid, ["pid", "command", "x"]),
                    10, "the attached view")
        assert {36, 32} <= colour_codes(tm.screen(escapes=True))  # cyan title, green "storm: none"
        tm.keys("q")
        assert tm.exit_status(10) == 0, tm.screen()
    finally:
        if tm is not None:
            tm.kill()
        if child is not None:
            child.close()
        agent.send_signal(signal.SIGTERM)
        try:
            rc = agent.wait(10)
        except subprocess.TimeoutExpired:
            agent.kill()
            rc = agent.wait(5)
        err.close()
    assert rc == 0, Path(err.name).read_text()
    assert not os.path.exists(sock)  # the agent removed its socket


def start_agent(prefix: list[str], env: dict, tmp_path: Path):
    """`mcp-agent run` (after prefix: nsenter, setpriv) until its socket answers: (process, stderr file)."""
    sock = env["MCP_AGENT_CONTROL_SOCKET"]
    err = open(tmp_path / "run.err", "w+")
    agent = subprocess.Popen([*prefix, *AGENT, "run", "--jsonl", "none", "--no-status"], env=env,
                             stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 30
    while not control.agent_answers(sock) and time.monotonic() < deadline:
        if agent.poll() is not None:
            err.close()
            raise AssertionError(Path(err.name).read_text())
        time.sleep(0.1)
    assert control.agent_answers(sock), Path(err.name).read_text()
    return agent, err


def stop_agent(agent, err) -> str:
    agent.send_signal(signal.SIGTERM)
    try:
        rc = agent.wait(10)
    except subprocess.TimeoutExpired:
        agent.kill()
        rc = agent.wait(5)
    err.close()
    text = Path(err.name).read_text()
    assert rc == 0, text
    return text


def set_link(ns: str, ifname: str, state: str):
    from pyroute2 import NetNS

    with NetNS(ns, flags=0) as ipr:
        ipr.link("set", index=ipr.link_lookup(ifname=ifname)[0], state=state)


@pytest.mark.bpf
@pytest.mark.skipif(shutil.which("tmux") is None or shutil.which("nsenter") is None, reason="needs tmux, nsenter")
def test_nic_link_events_on_screen_and_in_json(tmp_path):
    """`mcp-agent run` inside a network namespace made with pyroute2 that holds a veth pair, one end
    named with an escape sequence and a bidi override (the kernel allows both in interface names); `top`
    attached in an 80x24 tmux; one end set down and up again: both ends' carrier losses and comebacks on
    the screen, escaped, and in `top --json` with the links' state."""
    from pyroute2 import NetNS, netns

    ns = f"mcp-top-{os.getpid()}"
    plain, hostile, shown = "mcpA", "\x1b[7m\u202eq", "\\x1b[7m\\u202eq"
    netns.create(ns)
    agent = err = tm = None
    try:
        with NetNS(ns, flags=0) as ipr:
            ipr.link("add", ifname=plain, kind="veth", peer=hostile)
        for name in (plain, hostile):
            set_link(ns, name, "up")
        env = env_for(str(tmp_path / "agent.sock"), NO_COLOR="1", MCP_AGENT_STATUS_INTERVAL_S="0.5")
        agent, err = start_agent(["nsenter", f"--net=/var/run/netns/{ns}"], env, tmp_path)
        sock = env["MCP_AGENT_CONTROL_SOCKET"]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the veth pair's own coming up is no finding: wait it out
            nics = {n.name: n for n in control.fetch_snapshot(sock).host.nics}
            if set(nics) == {plain, shown} and all(n.carrier for n in nics.values()):
                break
            time.sleep(0.2)
        assert set(nics) == {plain, shown} and all(n.carrier for n in nics.values()), nics
        tm = Tmux(f"{sys.executable} -m mcp_hostagent top --interval 0.5", env, width=80, height=24)
        tm.wait(lambda s: "attached to agent socket" in s, 10, "the attached view")
        tm.keys("/", "no-such-process", "Enter")  # an empty table: the findings get its room
        tm.wait(lambda s: "no process matches filter" in s, 5, "the empty table")

        set_link(ns, plain, "down")
        s = tm.wait(lambda s: f"NIC {plain} carrier down (set down), operstate DOWN" in s
                    and f"NIC {shown} carrier down, operstate LOWERLAYERDOWN" in s, 10, "both carriers down")
        lines = s.splitlines()
        assert re.search(rf"NIC DOWN ({re.escape(shown)},{plain}|{plain},{re.escape(shown)})", lines[2]), lines[2]
        set_link(ns, plain, "up")
        s = tm.wait(lambda s: re.search(rf"NIC {plain} carrier up after \d+\.\ds; 1 flap in 60s", s)
                    and f"NIC {shown} carrier up" in s, 10, "both carriers back")
        lines = s.splitlines()
        assert len(lines) <= 24 and all(cells(ln) <= 80 for ln in lines)
        assert "NIC DOWN" not in lines[2]
        found = [ln for ln in lines if re.match(r"\d\d:\d\d:\d\d NIC ", ln)]
        assert len(found) == 4 and "carrier up" in found[0] and "carrier down" in found[-1], found  # newest first
        assert not colour_codes(tm.screen(escapes=True))
        tm.keys("q")

        r = subprocess.run([*AGENT, "top", "--json"], env=env, capture_output=True, text=True, timeout=20)
        assert r.returncode == 0, r.stderr
        snap = json.loads(r.stdout)
        assert snap["source"] == "socket" and snap["host"]["nic"] == "ok"
        kinds = [(f["subject"], f["kind"]) for f in snap["findings"] if f["kind"].startswith("nic_")]
        for name in (plain, shown):
            assert [k for n, k in kinds if n == name] == ["nic_carrier_up", "nic_carrier_down"], kinds
        nics = {n["name"]: n for n in snap["host"]["nics"]}
        assert nics[plain]["carrier"] and nics[plain]["admin_up"] and nics[plain]["flaps"] == 1
        assert nics[shown]["down_since_wall_ns"] is None and nics[shown]["operstate"] == "UP"
        assert "\x1b" not in r.stdout and "\u202e" not in json.loads(r.stdout)["host"]["nics"][0]["name"]
    finally:
        if tm is not None:
            tm.kill()
        if agent is not None:
            text = stop_agent(agent, err)
            assert "nic_netlink attached" in text, text
        netns.remove(ns)


@pytest.fixture
def temp_users():
    """A group and two users made for the test, one in the group and one not; removed whatever happens."""
    import grp

    tag = f"mcpt{os.getpid()}"
    group, member, outsider = f"{tag}g", f"{tag}in", f"{tag}out"
    made = []
    try:
        subprocess.run(["groupadd", group], check=True)
        made.append(["groupdel", group])
        for user, extra in ((member, ["-G", group]), (outsider, [])):
            subprocess.run(["useradd", "-M", "-N", "-g", "nogroup", *extra, "-s", "/usr/sbin/nologin", user],
                           check=True)
            made.append(["userdel", user])
        yield SimpleNamespace(group=group, gid=grp.getgrnam(group).gr_gid, member=member, outsider=outsider)
    finally:
        for cmd in reversed(made):
            subprocess.run(cmd, capture_output=True)


@pytest.mark.bpf
@pytest.mark.skipif(shutil.which("useradd") is None or shutil.which("setpriv") is None, reason="needs useradd, setpriv")
def test_control_group_lets_its_members_attach(tmp_path, temp_users):
    """control.group: the socket is the group's (mode 0660); a user in the group gets snapshots with
    `top --json`, a user not in it is refused with the socket's error."""
    d = tempfile.mkdtemp(prefix="mcp-top-", dir="/run")  # pytest's tmp_path is 0700: no other user gets in
    os.chmod(d, 0o755)
    env = env_for(f"{d}/agent.sock", MCP_AGENT_CONTROL_GROUP=temp_users.group)
    sock = env["MCP_AGENT_CONTROL_SOCKET"]
    agent, err = start_agent([], env, tmp_path)
    try:
        st = os.stat(sock)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, temp_users.gid, 0o660)

        def top_as(user):
            return subprocess.run(["setpriv", f"--reuid={user}", "--regid=nogroup", "--init-groups", *AGENT, "top",
                                   "--json"], env=env, capture_output=True, text=True, timeout=30)

        r = top_as(temp_users.member)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["source"] == "socket"
        r = top_as(temp_users.outsider)
        assert (r.returncode, r.stdout) == (1, "")
        assert r.stderr.startswith(f"mcp-agent: error: permission denied on {sock}; HINT: run as root or as a "
                                   "member of its group; starting the probes here needs root"), r.stderr
    finally:
        text = stop_agent(agent, err)
        shutil.rmtree(d, ignore_errors=True)
    assert f"  control:  {sock} (mode 0660, group {temp_users.group}; `mcp-agent top` attaches here)" in text


def test_control_group_unknown_is_a_config_error(tmp_path):
    env = env_for(str(tmp_path / "agent.sock"), MCP_AGENT_CONTROL_GROUP="mcp-no-such-group")
    for cmd in (["run", "--jsonl", "none"], ["top", "--once"]):
        r = subprocess.run([*AGENT, *cmd], env=env, capture_output=True, text=True, timeout=30)
        assert (r.returncode, r.stdout) == (2, ""), r.stderr
        assert r.stderr == ("mcp-agent: error: config error: MCP_AGENT_CONTROL_GROUP=\"mcp-no-such-group\": "
                            "no such group (a name in /etc/group or a numeric gid)\n")


SERVE = """
import os, sys
from mcp_hostagent import control
from mcp_hostagent.telemetry.snapshot import SnapshotBuilder
srv = control.serve(SnapshotBuilder(), print, sys.argv[1], sys.argv[2])
print(os.stat(sys.argv[1]).st_gid, control.agent_answers(sys.argv[1]))
srv.stop()
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root, setpriv")
def test_control_group_without_cap_chown(tmp_path):
    """Under the systemd unit the agent has no CAP_CHOWN: the group is given when the agent is a member
    of it (SupplementaryGroups=), else the socket stays root's and the line says why."""
    sock = str(tmp_path / "agent.sock")
    no_chown = ["setpriv", "--bounding-set=-chown", "--inh-caps=-chown"]
    r = subprocess.run([*no_chown, sys.executable, "-c", SERVE, sock, "nogroup"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    line, result = r.stdout.splitlines()
    assert line == (f"  control:  {sock} (mode 0660, group root, not given to group nogroup: chown: Operation not "
                    "permitted; HINT: the agent needs CAP_CHOWN or membership of that group (systemd: "
                    "SupplementaryGroups=); `mcp-agent top` attaches here)")
    assert result == "0 True"
    r = subprocess.run([*no_chown, "--groups=65534", sys.executable, "-c", SERVE, sock, "65534"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"  control:  {sock} (mode 0660, group nogroup; `mcp-agent top` attaches here)",
                                     "65534 True"]


@pytest.mark.bpf
def test_hostile_process_is_shown_safely(tmp_path):
    """A real process whose argument holds escape sequences, bidi overrides, wide characters, invalid
    UTF-8 and 3000 more bytes marks requests; top --json and --once show it escaped and bounded."""
    child = MarkedChild(args=(HOSTILE_ARG,)).start()
    env = env_for(str(tmp_path / "no-agent.sock"), COLUMNS="300")
    try:
        r = subprocess.run([*AGENT, "top", "--json", "--interval", "0.5"], env=env, capture_output=True, text=True,
                           timeout=40)
        assert r.returncode == 0, r.stderr
        snap = json.loads(r.stdout)
        assert snap["source"] == "local"
        (p,) = [p for p in snap["processes"] if p["pid"] == child.pid]
        for text in (p["command"], p["command_line"]):
            assert no_control_chars(text) and "\\x1b]0;pwned\\x07\\x1b[2J\\x1b[31m\\u202eevil\\xff\\xfe" in text
        assert len(p["command_line"]) <= 1024 and p["command_line"].endswith("…")
        r = subprocess.run([*AGENT, "top", "--once", "--interval", "0.5"], env=env, capture_output=True,
                           text=True, timeout=40)
        assert r.returncode == 0, r.stderr
        assert no_control_chars(r.stdout)
        row = next(ln for ln in r.stdout.splitlines() if ln.split()[:1] == [str(child.pid)])
        assert "\\x1b]0;pwned" in row and cells(row) <= 300
    finally:
        child.close()


@pytest.mark.bpf
def test_pipeline_snapshot_with_recorded_gpu_and_a_link_drop(make_agent, tmp_path):
    """The pipeline's own hooks (on_request, on_tick, on_link_episode) with real BPF for the requests and
    the H200 recording (NVML replay, sysfs tree) for the GPU: the process row gets its GPU, the header
    shows the narrowed link as DEGRADED, the findings show it going and coming back."""
    sys.path.insert(0, str(Path(__file__).parent.parent))
    from test_gpu_pipeline import busy_replay
    from test_pcie import gpu_dir, set_link

    with tarfile.open(Path(__file__).parent.parent / "fixtures" / "gpu" / "pci_sysfs.tar") as tf:
        tf.extractall(tmp_path / "sys", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    sysroot = tmp_path / "sys"
    child = MarkedChild()
    try:
        replay, _ = busy_replay(child.pid)
        a = make_agent(agent_kwargs={"nvml_module": replay, "sysfs_root": str(sysroot)},
                       gpu__sample_period_s=0.1, nic__enabled=False)
        child.start()

        def wait(pred, what, timeout=8.0):
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                s = a.agent.snapshots.latest()
                if pred(s):
                    return s
                time.sleep(0.1)
            raise AssertionError(f"no snapshot with {what}: {a.agent.snapshots.latest()}")

        def row(s):
            return next((p for p in s.processes if p.pid == child.pid), None)

        s = wait(lambda s: row(s) and row(s).gpus == (0,) and row(s).req_per_s and s.host.gpus, "the child on GPU 0")
        (g,) = s.host.gpus
        assert g.bus_id == "0000:00:06.0" and not g.link_degraded and s.host.nvml == "ok"
        set_link(gpu_dir(sysroot), width="8")
        s = wait(lambda s: s.host.gpus[0].link_degraded, "a degraded link")
        assert "width_drop" in s.host.gpus[0].link_why and s.host.gpus[0].link_width == 8
        text = "\n".join(line_text(ln) for ln in render(s, 120, 30, ViewState()))
        assert "Gen5x8/Gen5x16 DEGRADED" in text and "PCIe link downtrained on GPU 0 (0000:00:06.0)" in text
        set_link(gpu_dir(sysroot), width="16")
        s = wait(lambda s: not s.host.gpus[0].link_degraded, "the link back")
        assert [f.kind for f in s.findings][:2] == ["link_restored", "link_degraded"]
        assert a.agent.snapshots.errors == 0
    finally:
        child.close()
