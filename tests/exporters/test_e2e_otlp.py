"""End to end: the real Agent (real BPF, real exporters built from its config) -> a loopback OTLP
receiver over gRPC and HTTP/protobuf, and -> the default OTLP-JSON lines file. A child process
(tests/workloads/marked_child.py) marks one request that touches pages; the protobuf that arrives
must carry the request's trace context, counters, identity, resource and wall-clock times, and the
agent's health metrics must arrive too."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from otlp_receiver import GrpcReceiver, HttpReceiver, ReceivedMetric, ReceivedSpan, attrs

from mcp_hostagent import __version__
from mcp_hostagent.exporters.files import metrics_path
from mcp_hostagent.exporters.jsonl import ids_to_base64
from mcp_hostagent.core.kernel import tracepoint_exists
from mcp_hostagent.registry import UNIT

PROBES = UNIT.probes
switched_off = UNIT.switched_off
from mcp_hostagent.core.processes import METRIC_IDENTITY
from mcp_hostagent.telemetry.otel import instance_id

pytestmark = pytest.mark.bpf

TRACE_HEX, PARENT_HEX = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TP = f"00-{TRACE_HEX}-{PARENT_HEX}-01"
PAGES = 1500
# to_wall_ns adds one offset sampled at start to the kernel's CLOCK_MONOTONIC; the error is well under
# this, and the window measured around the request is wider than the request anyway.
CLOCK_SLACK_NS = 5_000_000
HEALTH_METRICS = ("hostagent.agent.probes", "hostagent.agent.spans.exported", "hostagent.agent.events.lost")


@pytest.fixture(autouse=True)
def _no_otel_env(monkeypatch):
    # the SDK exporters read OTEL_EXPORTER_OTLP_* (headers, certificates, compression...) themselves
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)


from test_bpf_requests import Child  # noqa: E402  (tests/workloads/marked_child.py, one command a line)


class AgentThread:
    """The real pipeline.Agent, exporters built from its config, its loop on a thread."""

    def __init__(self, overrides: dict):
        from mcp_hostagent.config import load_config
        from mcp_hostagent.registry import make_agent as Agent

        base = {"export.jsonl_path": "", "status.enabled": False, "process.watch": "marked",
                "export.metric_interval_s": 0.5}
        base.update(overrides)
        self.agent = Agent(load_config(None, env={}, overrides=base))
        self.report = self.agent.start()
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.agent.run, args=(self.stop_event,), daemon=True)
        self.thread.start()

    def close(self) -> bool:
        self.stop_event.set()
        self.thread.join(5)
        assert not self.thread.is_alive(), "agent loop did not stop within 5 s"
        return self.agent.stop(timeout_s=3.0)


class JsonlFile:
    """The JSONL sink read back like a receiver: each line parsed into the OTLP request it encodes."""

    def __init__(self, path):
        self.path = path
        self.lines: list[dict] = []

    def _read(self) -> list[dict]:
        out = []
        for path in (self.path, metrics_path(self.path)):  # spans, and metrics beside them
            try:
                with open(path) as f:
                    text = f.read()
            except FileNotFoundError:
                continue
            # only complete lines: the writer may be half-way through one
            out += [json.loads(ln) for ln in text.split("\n")[:-1] if ln]
        return out

    def spans(self) -> list[ReceivedSpan]:
        out = []
        for d in self._read():
            if "resourceSpans" in d:
                req = json_format.ParseDict(ids_to_base64(d), ExportTraceServiceRequest())
                out += [ReceivedSpan(s, attrs(rs.resource.attributes), ss.scope.name)
                        for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
        return out

    def metrics(self) -> list[ReceivedMetric]:
        out = []
        for d in self._read():
            if "resourceMetrics" in d:
                req = json_format.ParseDict(ids_to_base64(d), ExportMetricsServiceRequest())
                out += [ReceivedMetric(m, attrs(rm.resource.attributes), sm.scope.name)
                        for rm in req.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]
        return out

    def wait_for(self, predicate, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True


def points(metric) -> list:
    kind = metric.WhichOneof("data")
    return list(getattr(metric, kind).data_points) if kind else []


def value(point):
    return getattr(point, point.WhichOneof("value"))


def mark_request(child: Child, rid: int) -> tuple[int, int]:
    """Child marks request `rid` touching PAGES pages; returns the wall-clock window around it."""
    t0 = time.time_ns()
    child.do(f"begin {rid} {TP}", f"touch {PAGES}", f"end {rid}")
    t1 = time.time_ns()
    return t0, t1


def request_span(sink, child: Child, rid: int) -> ReceivedSpan:
    def mine():
        return [s for s in sink.spans() if s.attributes.get("process.pid") == child.pid
                and s.attributes.get("hostagent.request.id") == f"{rid:016x}"]

    assert sink.wait_for(lambda: bool(mine()), timeout=10), (
        f"no span for request {rid:016x} of pid {child.pid}; got {[s.attributes for s in sink.spans()]}")
    (got,) = mine()
    return got


def check_request_span(got: ReceivedSpan, child: Child, rid: int, window: tuple[int, int]) -> None:
    s, a = got.span, got.attributes
    assert s.name == "hostagent.request"
    assert s.trace_id.hex() == TRACE_HEX
    assert s.parent_span_id.hex() == PARENT_HEX
    assert len(s.span_id) == 8 and s.span_id.hex() not in ("0" * 16, PARENT_HEX)
    assert a["process.pid"] == child.pid
    assert a["thread.id"] == child.pid  # the child's main thread marks
    assert a["hostagent.request.id"] == f"{rid:016x}"
    assert a["hostagent.request.end_reason"] == "marked"
    assert a["hostagent.request.traceparent"] == "valid"
    assert a["hostagent.faults.user"] >= PAGES
    assert type(a["hostagent.faults.user"]) is int and type(a["process.pid"]) is int
    assert got.resource["service.name"] == "mcp-agent"
    assert got.resource["service.version"] == __version__
    assert got.resource["service.instance.id"] == instance_id("mcp-agent")  # stable: machine id + service
    assert got.resource["host.name"] == socket.gethostname()
    # the observed process is the span's resource (merged over the agent's); the span keeps its pid
    assert got.resource["process.pid"] == child.pid
    assert got.resource["process.executable.name"].startswith("python")
    assert not {"process.executable.name", "process.command_line", "process.owner", "container.id"} & set(a)
    assert got.scope == "mcp_hostagent"
    t0, t1 = window
    start, end = s.start_time_unix_nano, s.end_time_unix_nano
    assert t0 - CLOCK_SLACK_NS <= start <= end <= t1 + CLOCK_SLACK_NS, (
        f"span [{start}, {end}] outside the request's window [{t0}, {t1}] (ms: start-t0 "
        f"{(start - t0) / 1e6:.3f}, t1-end {(t1 - end) / 1e6:.3f})")
    assert end > start


def check_health_metrics(sink, child: Child, a: "AgentThread") -> None:
    def named(name):
        return [m for m in sink.metrics() if m.metric.name == name]

    def exported_at_least_one():
        return any(value(p) >= 1 for m in named("hostagent.agent.spans.exported") for p in points(m.metric))

    def child_faults():
        return [value(p) for m in named("hostagent.process.user_faults") for p in points(m.metric)
                if attrs(p.attributes).get("process.pid") == child.pid]

    def child_points():
        return [(m, attrs(p.attributes)) for m in sink.metrics() if m.metric.name.startswith(("hostagent.process.", "process."))
                for p in points(m.metric) if attrs(p.attributes).get("process.pid") == child.pid]

    # cumulative counters: a later export holds the count of spans exported after the request
    assert sink.wait_for(exported_at_least_one, timeout=10), (
        f"hostagent.agent.spans.exported never >= 1; metrics: {sorted({m.metric.name for m in sink.metrics()})}")
    assert sink.wait_for(lambda: all(named(n) for n in HEALTH_METRICS), timeout=5)
    assert sink.wait_for(lambda: any(v >= PAGES for v in child_faults()), timeout=10), child_faults()

    # per-process metrics: bounded labels (pid, executable, container, pod), never the command line;
    # metrics stay on the agent's resource, not a process's
    mine = child_points()
    assert {m.metric.name for m, _ in mine} >= {"hostagent.process.user_faults", "process.context_switches",
                                                "hostagent.process.offcpu.time", "process.paging.faults",
                                                "process.disk.io", "hostagent.process.numa.cpu.time"}
    for m, pa in mine:
        assert set(pa) - {"process.context_switch.type", "process.paging.fault_type", "hostagent.reclaim.kind",
                          "hostagent.runqueue.wait", "disk.io.direction", "hostagent.numa.locality"} \
            <= set(METRIC_IDENTITY), (m.metric.name, pa)
        assert "process.command_line" not in pa and "process.pid" not in m.resource
    assert {m.metric.unit for m, _ in mine if m.metric.name == "hostagent.process.offcpu.time"} == {"s"}
    # the request duration: an exponential histogram in seconds
    durations = [m.metric for m in named("hostagent.request.duration")]
    assert durations and {d.unit for d in durations} == {"s"}
    assert {d.WhichOneof("data") for d in durations} == {"exponential_histogram"}
    assert any(p.count >= 1 and attrs(p.attributes)["process.executable.name"].startswith("python")
               for d in durations for p in points(d))

    latest = {n: named(n)[-1] for n in HEALTH_METRICS}
    for m in latest.values():
        assert m.resource["service.name"] == "mcp-agent"
        assert m.resource["service.instance.id"] == instance_id("mcp-agent")
        assert m.resource["host.name"] == socket.gethostname()
    probes = {(attrs(p.attributes)["hostagent.probe"], attrs(p.attributes)["hostagent.probe.state"]): value(p)
              for p in points(latest["hostagent.agent.probes"].metric)}
    # one point per probe and per non-BPF source (NVML, PCIe sysfs, netlink) with the state the agent
    # decided; every tracepoint this kernel has attached
    expected = {(n, st.state): 1 for n, st in a.agent.plan.statuses.items()}
    sources = {**a.agent.caps["gpuhealth"].sources, **a.agent.caps["pcie"].sources, **a.agent.caps["nic"].sources, **a.agent.caps["numa"].sources}
    expected.update({(n, s.state): 1 for n, s in sources.items()})
    assert probes == expected
    assert len(probes) == len(PROBES) + len(sources) == len(PROBES) + 5
    off = switched_off(a.agent.cfg)  # group_fork: requests.group = cgroup
    for p in PROBES:
        if p.name in off:
            assert (p.name, "disabled") in probes, f"{p.name} not disabled: {sorted(probes)}"
        elif getattr(p, "kind", "tracepoint") == "tracepoint" and tracepoint_exists(*p.tracepoint.split(":")):
            assert (p.name, "attached") in probes, f"{p.name} not attached: {sorted(probes)}"
    lost = {attrs(p.attributes)["hostagent.where"]: value(p) for p in points(latest["hostagent.agent.events.lost"].metric)}
    # kernel: ring-buffer overruns, which other marking processes on a shared host can cause; user: ours
    assert set(lost) == {"kernel", "user"} and lost["user"] == 0 and lost["kernel"] >= 0, lost


@pytest.fixture
def child():
    c = Child()
    c.do("spin 1")  # up and warm
    yield c
    c.close()


@pytest.mark.parametrize("protocol,receiver_cls", [("grpc", GrpcReceiver), ("http/protobuf", HttpReceiver)])
def test_request_span_and_health_metrics_reach_otlp_receiver(protocol, receiver_cls, child):
    with receiver_cls() as rx:
        a = AgentThread({"export.otlp_endpoint": rx.endpoint, "export.otlp_protocol": protocol})
        try:
            assert a.report.sinks == [f"otlp {protocol}: {rx.endpoint}"]
            rid = 0x5EED0001
            window = mark_request(child, rid)
            check_request_span(request_span(rx, child, rid), child, rid, window)
            check_health_metrics(rx, child, a)
        finally:
            flushed = a.close()
        assert flushed
        assert rx.rejected == 0
        if protocol == "http/protobuf":
            assert all(h.get("content-type") == "application/x-protobuf" for h in rx.headers)


def test_request_span_in_default_jsonl_file(tmp_path, child):
    path = tmp_path / "telemetry.jsonl"
    a = AgentThread({"export.jsonl_path": str(path)})
    try:
        assert a.report.sinks == [f"jsonl: {path} (spans), {metrics_path(str(path))} (metrics)"]
        rid = 0x5EED0002
        window = mark_request(child, rid)
        sink = JsonlFile(path)
        got = request_span(sink, child, rid)
        check_request_span(got, child, rid, window)
        check_health_metrics(sink, child, a)
    finally:
        assert a.close()

    # the ids as written: lowercase hex (OTLP/JSON), not proto3-JSON's base64
    raw = [s for line in path.read_text().splitlines() for rs in json.loads(line).get("resourceSpans", [])
           for ss in rs["scopeSpans"] for s in ss["spans"]]
    (span,) = [s for s in raw if {"key": "hostagent.request.id", "value": {"stringValue": f"{rid:016x}"}}
               in s["attributes"]]
    assert span["traceId"] == TRACE_HEX
    assert span["parentSpanId"] == PARENT_HEX
    assert span["spanId"] == got.span.span_id.hex() and len(span["spanId"]) == 16
    assert span["name"] == "hostagent.request"
