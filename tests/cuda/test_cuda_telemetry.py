"""agent/cuda/telemetry.py: the zero-touch GPU step span (step_span) and the governor, ioctl and latency
metric rows (rows), exact."""

from __future__ import annotations

import pytest

from mcp_hostagent.core.decode import Counters, Header
from mcp_hostagent.cuda import telemetry as T
from mcp_hostagent.cuda.steps import GpuStep
from mcp_hostagent.telemetry.spec import SpanSpec

PROC = {"process.pid": 10, "process.executable.name": "python3"}


def step(begin_ns=1_000, ts_ns=5_000, sync_ns=700, kind="ctx", tid=11, **counters) -> GpuStep:
    return GpuStep(Header(type=0, tgid=10, tid=tid, cpu=0, ts_ns=ts_ns, cgroup_id=77, comm=b"python3"),
                   begin_ns, sync_ns, kind, Counters(**counters))


# ---- step_span ----

@pytest.mark.parametrize("st,expected", [
    # the step's counters, only the non-zero ones (no foundation four here: a step has none)
    (step(cu_launch_ex=800, cu_launch=3, cu_syncs=1, cu_sync_ns=700),
     SpanSpec("mcp.gpu_step", 1_000, 5_000, {
         **PROC, "thread.id": 11, "mcp.gpu_step.sync_kind": "ctx", "mcp.gpu_step.sync_ns": 700,
         "mcp.cuda.launches.cuLaunchKernel": 3, "mcp.cuda.launches.cuLaunchKernelEx": 800,
         "mcp.cuda.sync.count": 1, "mcp.cuda.sync.wait_ns": 700})),
    # a stream sync with ioctls, sampled (duty-cycled) launch counts
    (step(begin_ns=0, ts_ns=9, sync_ns=4, kind="stream", tid=12, cu_launch_ptsz=50, sampled=1, nv_ioctls=2,
          nv_ioctl_ns=40, cu_graph_launch=1),
     SpanSpec("mcp.gpu_step", 0, 9, {
         **PROC, "thread.id": 12, "mcp.gpu_step.sync_kind": "stream", "mcp.gpu_step.sync_ns": 4,
         "mcp.cuda.launches.cuLaunchKernel_ptsz": 50, "mcp.cuda.graph_launches": 1,
         "mcp.nvidia.ioctl.count": 2, "mcp.nvidia.ioctl.ns": 40, "mcp.cuda.sampled": 1})),
    # nothing counted: no counter attributes at all, zeros of the foundation's fields included
    (step(kind="event", sync_ns=0),
     SpanSpec("mcp.gpu_step", 1_000, 5_000, {
         **PROC, "thread.id": 11, "mcp.gpu_step.sync_kind": "event", "mcp.gpu_step.sync_ns": 0})),
    # an end before the begin (clock skew between CPUs): a zero-length span at the begin
    (step(begin_ns=6_000, ts_ns=5_000, faults=2),
     SpanSpec("mcp.gpu_step", 6_000, 6_000, {
         **PROC, "thread.id": 11, "mcp.gpu_step.sync_kind": "ctx", "mcp.gpu_step.sync_ns": 700,
         "mcp.faults.user": 2})),
])
def test_step_span(st, expected):
    assert T.step_span(st, PROC) == expected


def test_step_span_step_fields_win_and_process_attributes_are_copied():
    proc = {"thread.id": 1, "container.id": "c"}
    got = T.step_span(step(), proc)
    assert got.attributes == {"thread.id": 11, "container.id": "c", "mcp.gpu_step.sync_kind": "ctx",
                              "mcp.gpu_step.sync_ns": 700}
    assert proc == {"thread.id": 1, "container.id": "c"}
    assert (got.parent, got.links, got.events, got.children, got.error) == (None, (), (), (), None)


# ---- rows ----

GOVERNOR = {"budget": 0.02, "cost_ns": 1234.5, "calibrated_on": "standin", "weight": 4, "duty": 0.25,
            "weights": {"cu_launch": 4}, "launch_rate_hz": 98000.0, "attached_overhead": 0.121,
            "overhead": 0.0319, "toggles": 17, "unsteered": 2, "slice_s": 0.2, "attach_s": 0.01,
            "governor": True, "uprobes": "multi"}
IOCTLS = [
    {"pid": 10, "device": "/dev/nvidia0", "cmd": "0xc020462a", "type": "0x46", "nr": 42, "count": 12, "ns": 3400},
    {"pid": 11, "device": "/dev/nvidiactl", "cmd": "0xc0104629", "type": "0x46", "nr": 41, "count": 1, "ns": 90},
]
HISTS = [
    {"pid": 10, "kind": "sync", "le_ns": 1023, "count": 5},
    {"pid": 10, "kind": "ctx", "le_ns": 16383, "count": 2},
]


def test_rows():
    assert T.rows(GOVERNOR, IOCTLS, HISTS) == {
        "mcp.cuda.governor": [(0.02, {"mcp.governor.field": "budget"}),
                              (1234.5, {"mcp.governor.field": "cost_ns"}),
                              (0.25, {"mcp.governor.field": "duty"}),
                              (2, {"mcp.governor.field": "unsteered"}),
                              (98000.0, {"mcp.governor.field": "launch_rate_hz"}),
                              (0.121, {"mcp.governor.field": "attached_overhead"}),
                              (0.0319, {"mcp.governor.field": "overhead"})],
        "mcp.nvidia.ioctls": [
            (12, {"process.pid": 10, "mcp.nvidia.device": "/dev/nvidia0", "mcp.nvidia.ioctl.cmd": "0xc020462a"}),
            (1, {"process.pid": 11, "mcp.nvidia.device": "/dev/nvidiactl", "mcp.nvidia.ioctl.cmd": "0xc0104629"})],
        "mcp.nvidia.ioctl_ns": [
            (3400, {"process.pid": 10, "mcp.nvidia.device": "/dev/nvidia0", "mcp.nvidia.ioctl.cmd": "0xc020462a"}),
            (90, {"process.pid": 11, "mcp.nvidia.device": "/dev/nvidiactl", "mcp.nvidia.ioctl.cmd": "0xc0104629"})],
        "mcp.cuda.latency": [
            (5, {"process.pid": 10, "mcp.cuda.kind": "sync", "mcp.latency.le_ns": 1023}),
            (2, {"process.pid": 10, "mcp.cuda.kind": "ctx", "mcp.latency.le_ns": 16383})],
    }


def test_rows_governor_not_calibrated_and_nothing_counted():
    # before calibration cost_ns is None (governor_status): left out, not reported as 0; zeros stay
    gov = {**GOVERNOR, "cost_ns": None, "launch_rate_hz": 0.0, "attached_overhead": 0.0, "overhead": 0.0,
           "unsteered": 0, "duty": 1.0}
    assert T.rows(gov, [], []) == {
        "mcp.cuda.governor": [(0.02, {"mcp.governor.field": "budget"}),
                              (1.0, {"mcp.governor.field": "duty"}),
                              (0, {"mcp.governor.field": "unsteered"}),
                              (0.0, {"mcp.governor.field": "launch_rate_hz"}),
                              (0.0, {"mcp.governor.field": "attached_overhead"}),
                              (0.0, {"mcp.governor.field": "overhead"})],
        "mcp.nvidia.ioctls": [], "mcp.nvidia.ioctl_ns": [], "mcp.cuda.latency": []}


def test_rows_governor_fields_missing_from_the_status_are_left_out():
    assert T.rows({"budget": 0.05, "weight": 8}, [], [])["mcp.cuda.governor"] == [
        (0.05, {"mcp.governor.field": "budget"})]
