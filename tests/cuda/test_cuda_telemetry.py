"""agent/cuda/telemetry.py: the zero-touch GPU step span (step_span: the process's identity as its
resource, times in seconds) and the governor, ioctl and call-duration metric rows (rows), exact."""

from __future__ import annotations

import pytest

from mcp_hostagent.core.decode import Counters, Header
from mcp_hostagent.cuda import telemetry as T
from mcp_hostagent.cuda.steps import GpuStep
from mcp_hostagent.telemetry.spec import Log2Buckets, SpanSpec

PROC = {"process.pid": 10, "process.executable.name": "python3", "process.command_line": "python3 train.py"}
SPAN_PROC = {"process.pid": 10}  # of the identity, the span keeps the pid; the rest is its resource


def step(begin_ns=1_000, ts_ns=5_000, sync_ns=700, kind="ctx", tid=11, **counters) -> GpuStep:
    return GpuStep(Header(type=0, tgid=10, tid=tid, cpu=0, ts_ns=ts_ns, cgroup_id=77, comm=b"python3"),
                   begin_ns, sync_ns, kind, Counters(**counters))


# ---- step_span ----

@pytest.mark.parametrize("st,expected", [
    # the step's counters, only the non-zero ones (no foundation four here: a step has none); ns -> s
    (step(cu_launch_ex=800, cu_launch=3, cu_syncs=1, cu_sync_ns=700),
     SpanSpec("hostagent.gpu_step", 1_000, 5_000, {
         **SPAN_PROC, "thread.id": 11, "hostagent.gpu_step.sync.kind": "ctx", "hostagent.gpu_step.sync.time": 700 / 1e9,
         "hostagent.cuda.launches.cuLaunchKernel": 3, "hostagent.cuda.launches.cuLaunchKernelEx": 800,
         "hostagent.cuda.sync.count": 1, "hostagent.cuda.sync.time": 700 / 1e9}, resource=PROC)),
    # a stream sync with ioctls, sampled (duty-cycled) launch counts
    (step(begin_ns=0, ts_ns=9, sync_ns=4, kind="stream", tid=12, cu_launch_ptsz=50, sampled=1, nv_ioctls=2,
          nv_ioctl_ns=40, cu_graph_launch=1),
     SpanSpec("hostagent.gpu_step", 0, 9, {
         **SPAN_PROC, "thread.id": 12, "hostagent.gpu_step.sync.kind": "stream", "hostagent.gpu_step.sync.time": 4 / 1e9,
         "hostagent.cuda.launches.cuLaunchKernel_ptsz": 50, "hostagent.cuda.graph_launches": 1,
         "hostagent.nvidia.ioctl.count": 2, "hostagent.nvidia.ioctl.time": 40 / 1e9, "hostagent.cuda.sampled": 1},
              resource=PROC)),
    # nothing counted: no counter attributes at all, zeros of the foundation's fields included
    (step(kind="event", sync_ns=0),
     SpanSpec("hostagent.gpu_step", 1_000, 5_000, {
         **SPAN_PROC, "thread.id": 11, "hostagent.gpu_step.sync.kind": "event", "hostagent.gpu_step.sync.time": 0.0},
              resource=PROC)),
    # an end before the begin (clock skew between CPUs): a zero-length span at the begin; a field the
    # CUDA probes do not count (cu_thread holds only theirs) is not the step's to render
    (step(begin_ns=6_000, ts_ns=5_000, faults=2),
     SpanSpec("hostagent.gpu_step", 6_000, 6_000, {
         **SPAN_PROC, "thread.id": 11, "hostagent.gpu_step.sync.kind": "ctx", "hostagent.gpu_step.sync.time": 700 / 1e9},
              resource=PROC)),
])
def test_step_span(st, expected):
    got = T.step_span(st, PROC)
    assert got == expected
    assert all(isinstance(v, float) for k, v in got.attributes.items() if k.endswith(".time"))  # seconds


def test_step_span_process_identity_is_the_resource_and_step_fields_are_the_attributes():
    # the span keeps the record's pid and tid; whatever the identity says (even a stale pid or a
    # thread.id) stays on the resource, which is the process's dict, unchanged
    proc = {"process.pid": 99, "thread.id": 1, "container.id": "c", "process.command_line": "x --y"}
    got = T.step_span(step(), proc)
    assert got.attributes == {"process.pid": 10, "thread.id": 11, "hostagent.gpu_step.sync.kind": "ctx",
                              "hostagent.gpu_step.sync.time": 700 / 1e9}
    assert got.resource == {"process.pid": 99, "thread.id": 1, "container.id": "c", "process.command_line": "x --y"}
    assert proc == {"process.pid": 99, "thread.id": 1, "container.id": "c", "process.command_line": "x --y"}
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
HISTS = [  # as ioctl.hist_rows gives them: one row per (pid, kind, slot); slot s ends at 2^s - 1 ns
    {"pid": 10, "kind": "sync", "slot": 10, "le_ns": 1023, "count": 5},
    {"pid": 10, "kind": "ctx", "slot": 14, "le_ns": 16383, "count": 2},
    {"pid": 10, "kind": "sync", "slot": 12, "le_ns": 4095, "count": 1},
    {"pid": 9, "kind": "sync", "slot": 10, "le_ns": 1023, "count": 3},
]


def test_rows():
    assert T.rows(GOVERNOR, IOCTLS, HISTS) == {
        "hostagent.cuda.governor": [(0.02, {"hostagent.governor.field": "budget"}),
                              (1234.5, {"hostagent.governor.field": "cost_ns"}),
                              (0.25, {"hostagent.governor.field": "duty"}),
                              (2, {"hostagent.governor.field": "unsteered"}),
                              (98000.0, {"hostagent.governor.field": "launch_rate_hz"}),
                              (0.121, {"hostagent.governor.field": "attached_overhead"}),
                              (0.0319, {"hostagent.governor.field": "overhead"})],
        "hostagent.nvidia.ioctls": [
            (12, {"process.pid": 10, "hostagent.nvidia.device": "/dev/nvidia0", "hostagent.nvidia.ioctl.cmd": "0xc020462a"}),
            (1, {"process.pid": 11, "hostagent.nvidia.device": "/dev/nvidiactl", "hostagent.nvidia.ioctl.cmd": "0xc0104629"})],
        "hostagent.nvidia.ioctl.time": [
            (3400 / 1e9, {"process.pid": 10, "hostagent.nvidia.device": "/dev/nvidia0", "hostagent.nvidia.ioctl.cmd": "0xc020462a"}),
            (90 / 1e9, {"process.pid": 11, "hostagent.nvidia.device": "/dev/nvidiactl", "hostagent.nvidia.ioctl.cmd": "0xc0104629"})],
        # one histogram per process and kind, its slots gathered, sorted by (pid, kind)
        "hostagent.cuda.call.duration": [
            (Log2Buckets({10: 3}), {"process.pid": 9, "hostagent.cuda.kind": "sync"}),
            (Log2Buckets({14: 2}), {"process.pid": 10, "hostagent.cuda.kind": "ctx"}),
            (Log2Buckets({10: 5, 12: 1}), {"process.pid": 10, "hostagent.cuda.kind": "sync"})],
    }


def test_rows_governor_not_calibrated_and_nothing_counted():
    # before calibration cost_ns is None (governor_status): left out, not reported as 0; zeros stay
    gov = {**GOVERNOR, "cost_ns": None, "launch_rate_hz": 0.0, "attached_overhead": 0.0, "overhead": 0.0,
           "unsteered": 0, "duty": 1.0}
    assert T.rows(gov, [], []) == {
        "hostagent.cuda.governor": [(0.02, {"hostagent.governor.field": "budget"}),
                              (1.0, {"hostagent.governor.field": "duty"}),
                              (0, {"hostagent.governor.field": "unsteered"}),
                              (0.0, {"hostagent.governor.field": "launch_rate_hz"}),
                              (0.0, {"hostagent.governor.field": "attached_overhead"}),
                              (0.0, {"hostagent.governor.field": "overhead"})],
        "hostagent.nvidia.ioctls": [], "hostagent.nvidia.ioctl.time": [], "hostagent.cuda.call.duration": []}


def test_rows_governor_fields_missing_from_the_status_are_left_out():
    assert T.rows({"budget": 0.05, "weight": 8}, [], [])["hostagent.cuda.governor"] == [
        (0.05, {"hostagent.governor.field": "budget"})]
