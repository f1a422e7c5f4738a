"""telemetry/otel.py, what the export carries beyond the specs: the kernel's log2 histograms as SDK
histograms (log2_histogram_point, Telemetry.kernel_histograms, WithKernelHistograms in each metric
export), the stable service.instance.id (instance_id), and the resource per observed process on the
request and GPU step spans, through the real SDK pipeline (tests/telemetry/test_spec.py's pattern)."""

from __future__ import annotations

import gc
import socket
import uuid
import weakref

import pytest
from opentelemetry.sdk.metrics.export import (AggregationTemporality, Histogram, HistogramDataPoint, MetricExporter,
                                              MetricExportResult)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mcp_hostagent import __version__
from mcp_hostagent.core.capability import NONE, Evidence
from mcp_hostagent.core.decode import Counters, Header
from mcp_hostagent.core.processes import METRIC_IDENTITY, Processes
from mcp_hostagent.core.timebase import Timebase
from mcp_hostagent.cuda import telemetry as cuda_t
from mcp_hostagent.cuda.steps import GpuStep
from mcp_hostagent.exporters import Exporters
from mcp_hostagent.exporters.counting import CountingSpanExporter, ExportStats
from mcp_hostagent.reclaim.records import ReclaimStall
from mcp_hostagent.core import request as req_t
from mcp_hostagent.core.request import FinishedRequest
from mcp_hostagent.reclaim.telemetry import stall_span
from mcp_hostagent.telemetry import otel
from mcp_hostagent.telemetry.otel import LOG2_SLOTS, Telemetry, instance_id, log2_histogram_point
from mcp_hostagent.telemetry.spec import Instrument, Log2Buckets, SpanSpec

OFFSET = 1_700_000_000 * 10**9
BOUNDS_NS = [(1 << k) - 1 for k in range(8, 35)]  # 255 ns .. 2^34 - 1 ns (17.2 s)


class Capture(MetricExporter):
    """Keeps every MetricsData the reader hands its exporter."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs):
        self.batches.append(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        pass


def telemetry(metric_exporters=()):
    memory, stats = InMemorySpanExporter(), ExportStats()
    tel = Telemetry(service_name="t", exporters=Exporters(CountingSpanExporter(memory, stats), list(metric_exporters),
                                                          stats),
                    timebase=Timebase(offset_ns=OFFSET), schedule_delay_ms=10, metric_interval_s=3600)
    return tel, memory


def finished(tel, memory):
    tel.tracer_provider.force_flush(2000)
    return memory.get_finished_spans()


# ---- log2_histogram_point: the kernel's slots -> explicit-bucket counts in seconds ----

def test_log2_point_bounds_are_the_slots_upper_ends_in_seconds():
    p = log2_histogram_point(Log2Buckets({}), {"k": "v"}, 5, 9)
    assert isinstance(p, HistogramDataPoint)
    assert list(LOG2_SLOTS) == list(range(8, 35))
    assert list(p.explicit_bounds) == [ns / 1e9 for ns in BOUNDS_NS]
    assert p.explicit_bounds[0] == 255e-9 and p.explicit_bounds[-1] == 17.179869183
    assert list(p.bucket_counts) == [0] * (len(BOUNDS_NS) + 1)  # one more: +Inf
    assert (p.count, p.sum, p.min, p.max) == (0, None, None, None)  # the kernel keeps no sum, min, max
    assert (dict(p.attributes), p.start_time_unix_nano, p.time_unix_nano) == ({"k": "v"}, 5, 9)


@pytest.mark.parametrize("slot,bucket", [
    # slot s holds [2^(s-1), 2^s - 1] ns (bcc's bpf_log2l = floor(log2) + 1): its bucket is the one
    # bounded by 2^s - 1 ns
    (9, 1), (10, 2), (21, 13), (34, 26),
    # at or below slot 8 (<= 255 ns): the first bucket; above slot 34 (> 17.2 s): +Inf
    (0, 0), (1, 0), (7, 0), (8, 0), (35, 27), (48, 27), (63, 27),
])
def test_log2_point_puts_each_slot_in_its_bucket(slot, bucket):
    p = log2_histogram_point(Log2Buckets({slot: 3}), {}, 0, 1)
    assert [i for i, n in enumerate(p.bucket_counts) if n] == [bucket]
    assert p.bucket_counts[bucket] == 3 and p.count == 3
    # the bucket holds the slot's values: its bound is at least the slot's top and, below +Inf and
    # the folded first bucket, the bucket below ends under the slot's bottom
    bounds = list(p.explicit_bounds) + [float("inf")]
    if 8 <= slot <= 34:
        assert bounds[bucket] == ((1 << slot) - 1) / 1e9
        assert bucket == 0 or bounds[bucket - 1] < (1 << (slot - 1)) / 1e9


def test_log2_point_folds_low_and_high_slots_and_counts_all():
    b = Log2Buckets({1: 4, 5: 1, 8: 2, 9: 7, 20: 1, 34: 2, 35: 1, 40: 5})
    p = log2_histogram_point(b, {}, 0, 1)
    want = [0] * 28
    want[0], want[1], want[12], want[26], want[27] = 4 + 1 + 2, 7, 1, 2, 1 + 5
    assert list(p.bucket_counts) == want
    assert p.count == sum(b.slots.values()) == sum(p.bucket_counts) == 23


# ---- Telemetry.kernel_histograms and WithKernelHistograms ----

def test_kernel_histograms_from_published_rows_and_reads():
    tel, _ = telemetry()
    state = {"slots": {12: 1}}
    tel.declare([
        Instrument("k.pub", "log2_ns", "s", "published"),
        Instrument("k.read", "log2_ns", "s", "read", read=lambda: [(Log2Buckets(dict(state["slots"])), {"x": 1})]),
        Instrument("k.empty", "log2_ns", "s", "nothing yet"),
        Instrument("k.broken", "log2_ns", "s", "fails", read=lambda: 1 / 0),
    ])
    tel.publish({"k.pub": [(Log2Buckets({10: 2}), {"kind": "a", "gone": None}), (Log2Buckets({30: 1}), {"kind": "b"})]})
    state["slots"] = {12: 1, 13: 4}  # read at collection time, not at declaration
    got = {m.name: m for m in tel.kernel_histograms()}
    assert set(got) == {"k.pub", "k.read"}  # no rows: no metric; a failing read loses only its own
    pub, read = got["k.pub"], got["k.read"]
    assert (pub.unit, pub.description, read.unit) == ("s", "published", "s")
    assert isinstance(pub.data, Histogram) and pub.data.aggregation_temporality == AggregationTemporality.CUMULATIVE
    assert [(dict(p.attributes), p.count) for p in pub.data.data_points] == [({"kind": "a"}, 2), ({"kind": "b"}, 1)]
    assert pub.data.data_points[0].bucket_counts[2] == 2 and pub.data.data_points[1].bucket_counts[22] == 1
    (rp,) = read.data.data_points
    assert (dict(rp.attributes), rp.count, rp.bucket_counts[4], rp.bucket_counts[5]) == ({"x": 1}, 5, 1, 4)
    # cumulative since the agent started: every point's start is the Telemetry's start
    assert {p.start_time_unix_nano for m in got.values() for p in m.data.data_points} == {tel._start_wall_ns}
    assert all(p.time_unix_nano >= p.start_time_unix_nano for m in got.values() for p in m.data.data_points)
    tel.shutdown()


def test_kernel_histograms_join_each_metric_export_in_the_agent_scope():
    cap = Capture()
    tel, _ = telemetry([cap])
    tel.declare([Instrument("g", "gauge", "1", "a gauge", read=lambda: [(1, {})]),
                 Instrument("hostagent.reclaim.stall.duration", "log2_ns", "s", "stalls")])
    tel.publish({"hostagent.reclaim.stall.duration": [(Log2Buckets({21: 3}), {"hostagent.reclaim.kind": "direct"})]})
    tel.flush(5)
    data = cap.batches[-1]
    (rm,) = data.resource_metrics
    assert rm.resource.attributes["service.instance.id"] == instance_id("t")
    (sm,) = [sm for sm in rm.scope_metrics if sm.scope.name == "mcp_hostagent"]
    by_name = {m.name: m for m in sm.metrics}
    assert set(by_name) == {"g", "hostagent.reclaim.stall.duration"}  # beside the SDK's own, same scope
    (p,) = by_name["hostagent.reclaim.stall.duration"].data.data_points
    assert (dict(p.attributes), p.count, p.bucket_counts[13]) == ({"hostagent.reclaim.kind": "direct"}, 3, 3)
    tel.shutdown()


def test_request_duration_is_an_exponential_histogram_in_seconds():
    from opentelemetry.sdk.metrics.export import ExponentialHistogram

    cap = Capture()
    tel, _ = telemetry([cap])
    tel.declare(list(req_t.INSTRUMENTS))
    for fr in (finished_request(end_ns=1_000_000 + 2_500_000), finished_request(end_ns=1_000_000 + 40_000_000)):
        tel.record(req_t.DURATION, *req_t.duration_row(fr, PROC))
    tel.flush(5)
    (m,) = [m for rm in cap.batches[-1].resource_metrics for sm in rm.scope_metrics for m in sm.metrics
            if m.name == "hostagent.request.duration"]
    assert m.unit == "s" and isinstance(m.data, ExponentialHistogram)
    (p,) = m.data.data_points
    assert dict(p.attributes) == {"process.executable.name": "srv", "process.owner": "alice", "container.id": "c" * 64,
                                  "k8s.pod.uid": "9b7e1f0c-0000-4000-8000-000000000001",
                                  "hostagent.request.end_reason": "marked"}
    assert p.count == 2 and p.sum == pytest.approx(0.0425) and (p.min, p.max) == (0.0025, 0.04)
    tel.shutdown()


# ---- instance_id: service.instance.id, stable ----

def test_instance_id_is_stable_for_the_same_machine_and_service(tmp_path):
    mid = tmp_path / "machine-id"
    mid.write_text("0123456789abcdef0123456789abcdef\n")
    a = instance_id("mcp-agent", env={}, machine_id_path=str(mid))
    assert a == instance_id("mcp-agent", env={}, machine_id_path=str(mid))  # a restart: the same
    assert a == str(uuid.uuid5(uuid.NAMESPACE_OID, "0123456789abcdef0123456789abcdef/mcp-agent"))
    assert uuid.UUID(a).version == 5
    assert instance_id("other-agent", env={}, machine_id_path=str(mid)) != a  # another service
    mid.write_text("fedcba9876543210fedcba9876543210\n")
    assert instance_id("mcp-agent", env={}, machine_id_path=str(mid)) != a  # another machine


def test_instance_id_without_a_machine_id_uses_the_hostname(tmp_path):
    want = str(uuid.uuid5(uuid.NAMESPACE_OID, f"{socket.gethostname()}/mcp-agent"))
    assert instance_id("mcp-agent", env={}, machine_id_path=str(tmp_path / "absent")) == want
    (tmp_path / "empty").write_text("\n")
    assert instance_id("mcp-agent", env={}, machine_id_path=str(tmp_path / "empty")) == want


@pytest.mark.parametrize("value,want", [
    ("service.instance.id=node-7", "node-7"),
    ("k8s.node.name=n1, service.instance.id = node-7 ,deployment.environment=prod", "node-7"),
])
def test_instance_id_from_otel_resource_attributes(tmp_path, value, want):
    mid = tmp_path / "machine-id"
    mid.write_text("0123456789abcdef0123456789abcdef\n")
    assert instance_id("mcp-agent", env={"OTEL_RESOURCE_ATTRIBUTES": value}, machine_id_path=str(mid)) == want
    # one the variable does not set, or sets empty: the derived one
    derived = instance_id("mcp-agent", env={}, machine_id_path=str(mid))
    for other in ("k8s.node.name=n1", "service.instance.id=", ""):
        assert instance_id("mcp-agent", env={"OTEL_RESOURCE_ATTRIBUTES": other}, machine_id_path=str(mid)) == derived


def test_the_agent_resource_carries_the_instance_id(monkeypatch):
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    tel, memory = telemetry()
    assert tel.resource.attributes["service.instance.id"] == instance_id("t")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=node-7")
    tel2, _ = telemetry()
    assert tel2.resource.attributes["service.instance.id"] == "node-7"
    tel.shutdown()
    tel2.shutdown()


# ---- a resource per observed process, through the real SDK pipeline ----

PROC = {"process.pid": 10, "process.executable.name": "srv", "process.command_line": "srv --port 80",
        "process.owner": "alice", "process.creation.time": "2026-12-03T10:00:00Z", "container.id": "c" * 64,
        "container.runtime": "containerd", "k8s.pod.uid": "9b7e1f0c-0000-4000-8000-000000000001",
        "hostagent.cgroup.path": "/sys/fs/cgroup/kubepods.slice/x.scope"}


def finished_request(tgid=10, tid=11, request_id=0xABC, end_ns=3_500_000) -> FinishedRequest:
    return FinishedRequest(tgid=tgid, tid=tid, request_id=request_id, comm=b"srv", cgroup_id=4242, begin_ns=1_000_000,
                           end_ns=end_ns, parent=None, traceparent_state="missing", end_reason="marked",
                           counters=Counters(faults=3, offcpu_ns=2_000_000))


class _Req:
    """The request span as the registry's request path makes it (an agent made, not started), with the
    given evidence beside its own."""

    _agent = None

    @classmethod
    def request_span(cls, fr, proc, ev, stalls=()):
        if cls._agent is None:
            from mcp_hostagent.config import load_config
            from mcp_hostagent.registry import make_agent

            cls._agent = make_agent(load_config(None, env={}), nvml_module=object())
        attrs, _ = cls._agent.path.evidence(fr)
        return SpanSpec(req_t.SPAN_NAME, fr.begin_ns, fr.end_ns, {**attrs, **ev.attributes},
                        children=tuple(stall_span(s) for s in stalls), resource=proc)


spans_of = _Req


def hdr(tgid=10, tid=11, ts_ns=0) -> Header:
    return Header(type=0, tgid=tgid, tid=tid, cpu=0, ts_ns=ts_ns, cgroup_id=77, comm=b"srv")


def test_request_span_resource_is_the_agent_resource_plus_the_process_identity():
    tel, memory = telemetry()
    stall = ReclaimStall(hdr(ts_ns=1_600_000), "direct", 1_200_000, 32, 0xCC0, 0, 0xABC)
    tel.span(spans_of.request_span(finished_request(), PROC, Evidence({"hostagent.gpu.index": 0}), stalls=(stall,)))
    spans = {s.name: s for s in finished(tel, memory)}
    req, st = spans["hostagent.request"], spans["hostagent.reclaim.stall"]
    res = dict(req.resource.attributes)
    agent = dict(tel.resource.attributes)
    assert res == {**agent, **PROC}  # merged over the agent's: service.*, host.name, telemetry.sdk.*
    assert (res["service.name"], res["service.version"], res["service.instance.id"]) == ("t", __version__, instance_id("t"))
    # the span's own attributes: of the identity only process.pid and thread.id
    a = dict(req.attributes)
    assert (a["process.pid"], a["thread.id"], a["hostagent.gpu.index"]) == (10, 11, 0)
    assert not set(a) & (set(PROC) - {"process.pid"})
    assert a["hostagent.offcpu.time"] == 0.002 and a["hostagent.faults.user"] == 3
    # its stall child is on a thread of the same process: the same resource, its parent the request
    assert dict(st.resource.attributes) == res and st.parent.span_id == req.context.span_id
    assert st.attributes["hostagent.reclaim.stall.time"] == 0.0004
    tel.shutdown()


def test_each_process_gets_its_resource_and_the_agent_spans_keep_the_agent_one():
    tel, memory = telemetry()
    other = {**PROC, "process.pid": 20, "process.command_line": "srv --port 81"}
    tel.span(spans_of.request_span(finished_request(request_id=1), PROC, NONE))
    tel.span(spans_of.request_span(finished_request(tgid=20, tid=21, request_id=2), other, NONE))
    tel.span(spans_of.request_span(finished_request(request_id=3), dict(PROC), NONE))  # equal: the same resource
    step = GpuStep(hdr(tgid=20, tid=22, ts_ns=9_000), 1_000, 700, "stream", Counters(cu_launch=7))
    tel.span(cuda_t.step_span(step, other))
    tel.open("storm", SpanSpec("hostagent.reclaim_storm", 100, None, {"hostagent.storm.scope": "host"}))
    tel.close("storm", {}, 200)
    got = finished(tel, memory)
    by = {(s.name, s.attributes.get("hostagent.request.id")): s for s in got}
    r1, r2, r3 = (by[("hostagent.request", f"{i:016x}")] for i in (1, 2, 3))
    stp, storm = by[("hostagent.gpu_step", None)], by[("hostagent.reclaim_storm", None)]
    assert r1.resource.attributes["process.pid"] == 10 and r2.resource.attributes["process.pid"] == 20
    assert r1.resource.attributes["process.command_line"] == "srv --port 80"
    assert r2.resource.attributes["process.command_line"] == "srv --port 81"
    assert r1.resource is r3.resource  # one provider per process, reused
    assert stp.resource is r2.resource and stp.attributes["process.pid"] == 20 and stp.attributes["thread.id"] == 22
    assert stp.attributes["hostagent.gpu_step.sync.time"] == 700 / 1e9
    assert storm.resource is tel.resource and "process.pid" not in storm.resource.attributes
    assert tel.stats.snapshot()["spans_exported"] == 5  # all through the one batch processor, counted once
    tel.shutdown()


def test_process_providers_are_bounded_and_freed(monkeypatch):
    from opentelemetry.sdk.trace import TracerProvider

    made = []

    def provider(*args, **kwargs):  # the SDK's, each one made noted (weakly)
        p = TracerProvider(*args, **kwargs)
        made.append(weakref.ref(p))
        return p

    monkeypatch.setattr(otel, "MAX_PROCESS_RESOURCES", 4)
    tel, memory = telemetry()
    monkeypatch.setattr(otel, "TracerProvider", provider)
    for pid in range(1, 12):
        tel.span(spans_of.request_span(finished_request(tgid=pid), {**PROC, "process.pid": pid}, NONE))
    assert len(made) == 11 and len(tel._process_tracers) == 4
    assert [dict(k)["process.pid"] for k in tel._process_tracers] == [8, 9, 10, 11]  # the latest
    assert len(finished(tel, memory)) == 11  # the shared processor exported them all
    memory.clear()
    gc.collect()
    # nothing (such as the SDK's atexit hook) keeps a process's provider: the agent keeps the latest
    # processes' tracers only (each with its resource), or every process it ever saw would stay in memory
    assert [r() is None for r in made] == [True] * 11
    tel.span(spans_of.request_span(finished_request(tgid=3), {**PROC, "process.pid": 3}, NONE))  # again: a new one
    assert len(made) == 12 and [dict(k)["process.pid"] for k in tel._process_tracers] == [9, 10, 11, 3]
    assert [s.resource.attributes["process.pid"] for s in finished(tel, memory)] == [3]
    tel.shutdown()


# ---- per-process metrics: bounded labels ----

def process_instruments(tmp_path):
    """Every per-process metric: the core's (/proc accounting) and each capability's of its counters."""
    from mcp_hostagent.config import load_config
    from mcp_hostagent.registry import make_agent

    agent = make_agent(load_config(None, env={}), proc_root=str(tmp_path), nvml_module=object())
    insts = [*agent.processes.instruments(), *(i for cap in agent.caps.values() for i in cap.instruments())]
    return agent.processes, [i for i in insts if i.name.startswith(("hostagent.process.", "process."))]


def test_per_process_metrics_carry_no_command_line_only_bounded_identity(tmp_path):
    procs, insts = process_instruments(tmp_path)
    procs.set_rows({10: (PROC, Counters(faults=5, vcsw=2, ivcsw=1, offcpu_ns=3_000_000, direct_reclaims=1,
                                        direct_reclaim_ns=400, cu_launch=9, cu_sync_ns=7_000, cu_ctx_ns=80,
                                        offcpu_runnable_ns=2_000, wakeup_wait_ns=5_000, oncpu_ns=9_000,
                                        oncpu_homed_ns=6_000, oncpu_remote_ns=1_000,
                                        pagecache_added_bytes=3 << 20))},
                   {10: (100, 2)})
    bounded = {k: PROC[k] for k in METRIC_IDENTITY}
    assert bounded == {"process.pid": 10, "process.executable.name": "srv", "container.id": "c" * 64,
                       "k8s.pod.uid": "9b7e1f0c-0000-4000-8000-000000000001"}
    rows = {i.name: (i.unit, i.read()) for i in insts}
    assert rows == {
        "hostagent.process.user_faults": ("{fault}", [(5, bounded)]),
        "process.context_switches": ("{context_switch}", [(2, {**bounded, "process.context_switch.type": "voluntary"}),
                                                          (1, {**bounded, "process.context_switch.type": "involuntary"})]),
        "hostagent.process.offcpu.time": ("s", [(0.003, bounded)]),
        "hostagent.process.page_cache.added": ("By", [(3 << 20, bounded)]),
        "hostagent.process.numa.cpu.time": ("s", [(5_000 / 1e9, {**bounded, "hostagent.numa.locality": "local"}),
                                                  (1_000 / 1e9, {**bounded, "hostagent.numa.locality": "remote"}),
                                                  (3_000 / 1e9, {**bounded, "hostagent.numa.locality": "unknown"})]),
        "hostagent.process.runqueue.wait.time": ("s", [(2_000 / 1e9, {**bounded, "hostagent.runqueue.wait": "preempted"}),
                                                       (5_000 / 1e9, {**bounded, "hostagent.runqueue.wait": "wakeup"})]),
        "process.paging.faults": ("{fault}", [(100, {**bounded, "process.paging.fault_type": "minor"}),
                                              (2, {**bounded, "process.paging.fault_type": "major"})]),
        "process.disk.io": ("By", []),  # no /proc/PID/io row given
        "hostagent.process.reclaim.stall.time": ("s", [(400 / 1e9, {**bounded, "hostagent.reclaim.kind": "direct"}),
                                                       (0.0, {**bounded, "hostagent.reclaim.kind": "memcg"})]),
        "hostagent.process.reclaim.stalls": ("{stall}", [(1, {**bounded, "hostagent.reclaim.kind": "direct"}),
                                                         (0, {**bounded, "hostagent.reclaim.kind": "memcg"})]),
        "hostagent.process.cuda.launches": ("{launch}", [(9, bounded)]),
        "hostagent.process.cuda.sync.time": ("s", [(7_000 / 1e9, bounded)]),
        "hostagent.process.cuda.ctx.time": ("s", [(80 / 1e9, bounded)]),
        "hostagent.process.cuda.alloc.out_of_memory": ("{error}", [(0, bounded)]),
    }
    for _, (_, points) in rows.items():
        for _, attrs in points:
            assert "process.command_line" not in attrs and "process.owner" not in attrs
            assert "hostagent.cgroup.path" not in attrs and "process.creation.time" not in attrs


def test_per_process_metrics_exported_without_the_command_line(tmp_path):
    cap = Capture()
    tel, _ = telemetry([cap])
    procs, insts = process_instruments(tmp_path)
    procs.set_rows({10: (PROC, Counters(faults=5))}, {})
    tel.declare(insts)
    tel.flush(5)
    points = [(m.name, dict(p.attributes)) for rm in cap.batches[-1].resource_metrics for sm in rm.scope_metrics
              for m in sm.metrics for p in m.data.data_points]
    assert {n for n, _ in points} >= {"hostagent.process.user_faults", "process.context_switches",
                                      "hostagent.process.offcpu.time"}
    assert all(set(a) - {"process.context_switch.type", "hostagent.reclaim.kind", "hostagent.runqueue.wait"}
               == set(METRIC_IDENTITY)
               for _, a in points), points
    assert all("process.pid" not in rm.resource.attributes for rm in cap.batches[-1].resource_metrics)
    tel.shutdown()
