"""Exporters against the real SDK and real loopback OTLP receivers (gRPC and HTTP/protobuf)."""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import resource
import signal
import stat
import threading

import pytest
from google.protobuf import json_format
from opentelemetry import trace
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, TraceFlags
from otlp_receiver import GrpcReceiver, HttpReceiver

from mcp_hostagent.exporters import (
    ConsoleSpanExporter,
    CountingBatchSpanProcessor,
    CountingSpanExporter,
    ExportStats,
    JsonlSpanExporter,
    JsonlWriter,
    MultiSpanExporter,
    build_exporters,
)
from mcp_hostagent.exporters.counting import _RateLimitFilter

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_ID = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01"
LINK_TRACE_ID, LINK_SPAN_ID = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
START_NS = 1_700_000_000_123_456_789
END_NS = START_NS + 2_500_000
ATTRS = {"hostagent.pid": 4242, "hostagent.comm": "python3", "hostagent.reclaim_stall_ns": 1_234_567}
RESOURCE = Resource.create({"service.name": "mcp-agent-test", "host.name": "testhost"})
PROTOCOLS = [("grpc", GrpcReceiver), ("http/protobuf", HttpReceiver)]


@pytest.fixture(autouse=True)
def _no_otlp_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)


def parent_context(traceparent: str):
    version, trace_id, span_id, flags = traceparent.split("-")
    assert version == "00"
    sc = SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=TraceFlags(int(flags, 16)))
    return trace.set_span_in_context(NonRecordingSpan(sc))


def emit_span(processor, links=(), shutdown=True) -> None:
    """One span with a W3C-traceparent parent, fixed times and attributes, flushed through `processor`."""
    provider = TracerProvider(resource=RESOURCE)
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("mcp_hostagent.test")
    ctx = parent_context(TRACEPARENT)
    span = tracer.start_span("reclaim_stall", context=ctx, start_time=START_NS, attributes=ATTRS, links=links)
    span.end(end_time=END_NS)
    assert provider.force_flush(5000)
    if shutdown:  # also shuts the exporters down
        provider.shutdown()


def emit_counter(metric_exporters, value_a=3, value_b=4) -> MeterProvider:
    readers = [PeriodicExportingMetricReader(e, export_interval_millis=3_600_000) for e in metric_exporters]
    provider = MeterProvider(resource=RESOURCE, metric_readers=readers)
    counter = provider.get_meter("mcp_hostagent.test").create_counter("hostagent.test.events", unit="1")
    counter.add(value_a, {"hostagent.comm": "python3"})
    counter.add(value_b, {"hostagent.comm": "python3"})
    provider.force_flush(5000)
    return provider


def batch_processor(exporters, **kw):
    kw = {"max_queue_size": 64, "schedule_delay_ms": 50, "max_export_batch_size": 16, **kw}
    return CountingBatchSpanProcessor(exporters.span_exporter, exporters.stats, **kw)


@pytest.mark.parametrize("protocol,receiver_cls", PROTOCOLS)
def test_span_reaches_receiver(protocol, receiver_cls, monkeypatch):
    if protocol == "http/protobuf":
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")  # read by the SDK, not by us
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-mcp-token=s3cret")
    with receiver_cls() as rx:
        exporters = build_exporters(None, rx.endpoint, protocol)
        emit_span(batch_processor(exporters))
        [got] = rx.wait_for_spans(1, timeout=5)

    s = got.span
    assert s.name == "reclaim_stall"
    assert s.trace_id == TRACE_ID.to_bytes(16, "big")
    assert s.parent_span_id == PARENT_ID.to_bytes(8, "big")
    assert len(s.span_id) == 8 and s.span_id != PARENT_ID.to_bytes(8, "big")
    assert (s.start_time_unix_nano, s.end_time_unix_nano) == (START_NS, END_NS)
    assert got.attributes == ATTRS
    assert type(got.attributes["hostagent.pid"]) is int
    assert got.resource["service.name"] == "mcp-agent-test"
    assert got.scope == "mcp_hostagent.test"
    assert rx.headers[0]["x-mcp-token"] == "s3cret"
    if protocol == "http/protobuf":
        assert rx.headers[0]["content-encoding"] == "gzip"
    assert exporters.stats.snapshot()["spans_exported"] == 1


@pytest.mark.parametrize("protocol,receiver_cls", PROTOCOLS)
def test_counter_reaches_receiver(protocol, receiver_cls):
    with receiver_cls() as rx:
        exporters = build_exporters(None, rx.endpoint, protocol)
        provider = emit_counter(exporters.metric_exporters)
        [got] = rx.wait_for_metric("hostagent.test.events", timeout=5)
        provider.shutdown()

    m = got.metric
    assert got.resource["service.name"] == "mcp-agent-test"
    assert m.sum.is_monotonic and m.sum.aggregation_temporality == 2  # CUMULATIVE
    [point] = m.sum.data_points
    assert point.as_int == 7
    assert exporters.stats.snapshot()["metrics_exports_ok"] >= 1


def test_otlp_from_env_only(monkeypatch):
    with HttpReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        exporters = build_exporters(None, None, None)
        assert exporters.describe() == [
            f"otlp http/protobuf traces: {rx.endpoint} (from env)",
            f"otlp http/protobuf metrics: {rx.endpoint} (from env)",
        ]
        emit_span(batch_processor(exporters))
        assert rx.wait_for_spans(1)[0].span.trace_id == TRACE_ID.to_bytes(16, "big")


def hex_ids_to_base64(line: dict) -> dict:
    """Independent of exporters.jsonl: undo OTLP/JSON's hex ids at the places spans keep them."""
    b64 = lambda h: base64.b64encode(bytes.fromhex(h)).decode()  # noqa: E731
    line = json.loads(json.dumps(line))
    for rs in line["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                for obj in [span, *span.get("links", [])]:
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if key in obj:
                            obj[key] = b64(obj[key])
    return line


def test_jsonl_lines_are_otlp_json(tmp_path):
    path = tmp_path / "state" / "mcp-agent" / "telemetry.jsonl"
    exporters = build_exporters(str(path), None, "grpc")
    mpath = path.with_name("telemetry.metrics.jsonl")
    assert exporters.describe() == [f"jsonl: {path} (spans), {mpath} (metrics)"]
    link_ctx = SpanContext(LINK_TRACE_ID, LINK_SPAN_ID, is_remote=True, trace_flags=TraceFlags(1))
    link = Link(link_ctx, {"hostagent.link": "cause"})
    emit_span(batch_processor(exporters), links=[link])
    emit_counter(exporters.metric_exporters).shutdown()

    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o750
    assert stat.S_IMODE(path.parent.parent.stat().st_mode) == 0o750
    assert stat.S_IMODE(mpath.stat().st_mode) == 0o640
    # one signal per file: spans in the path given, metrics beside it
    lines = [json.loads(text) for text in path.read_text().splitlines()]
    mlines = [json.loads(text) for text in mpath.read_text().splitlines()]
    assert [list(line) for line in lines] == [["resourceSpans"]]
    assert [list(line) for line in mlines] == [["resourceMetrics"], ["resourceMetrics"]]

    span_line = lines[0]
    span = span_line["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert span["traceId"] == f"{TRACE_ID:032x}"
    assert span["parentSpanId"] == f"{PARENT_ID:016x}"
    assert len(span["spanId"]) == 16 and int(span["spanId"], 16)
    assert span["links"][0]["traceId"] == f"{LINK_TRACE_ID:032x}"
    assert span["links"][0]["spanId"] == f"{LINK_SPAN_ID:016x}"
    assert span["kind"] == 1  # SPAN_KIND_INTERNAL as an integer
    assert (span["startTimeUnixNano"], span["endTimeUnixNano"]) == (str(START_NS), str(END_NS))
    assert {"key": "hostagent.pid", "value": {"intValue": "4242"}} in span["attributes"]

    msg = json_format.ParseDict(hex_ids_to_base64(span_line), ExportTraceServiceRequest())
    pb_span = msg.resource_spans[0].scope_spans[0].spans[0]
    assert pb_span.trace_id == TRACE_ID.to_bytes(16, "big") and pb_span.parent_span_id == PARENT_ID.to_bytes(8, "big")
    assert pb_span.links[0].span_id == LINK_SPAN_ID.to_bytes(8, "big")
    assert pb_span.start_time_unix_nano == START_NS
    assert hex_ids_to_base64(span_line) == json_format.MessageToDict(msg, use_integers_for_enums=True)

    metrics = json_format.ParseDict(mlines[0], ExportMetricsServiceRequest())
    m = metrics.resource_metrics[0].scope_metrics[0].metrics[0]
    assert m.name == "hostagent.test.events" and m.sum.data_points[0].as_int == 7
    assert m.sum.aggregation_temporality == 2
    assert exporters.stats.snapshot() == {
        "spans_exported": 1,
        "spans_failed": 0,
        "spans_dropped_queue": 0,
        "metrics_exports_ok": 2,
        "metrics_exports_failed": 0,
    }


def test_jsonl_reopens_after_rotation_and_removal(tmp_path):
    path = tmp_path / "t.jsonl"
    writer = JsonlWriter(path)
    processor = SimpleSpanProcessor(JsonlSpanExporter(writer))
    emit_span(processor, shutdown=False)
    os.rename(path, tmp_path / "t.jsonl.1")  # logrotate's default: rename, then the writer must reopen
    emit_span(processor, shutdown=False)
    assert len((tmp_path / "t.jsonl.1").read_text().splitlines()) == 1
    assert len(path.read_text().splitlines()) == 1
    path.unlink()
    emit_span(processor)
    assert len(path.read_text().splitlines()) == 1
    assert writer.lines_written == 3 and writer.write_errors == 0


@pytest.mark.parametrize("target", ["/dev/full", "not-a-dir"])
def test_jsonl_write_error_is_a_counted_failure(tmp_path, target):
    if target == "/dev/full" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    if target == "not-a-dir":
        (tmp_path / "file").write_text("")
        target = str(tmp_path / "file" / "t.jsonl")  # ENOTDIR when creating the parent
    writer = JsonlWriter(target)
    stats = ExportStats()
    emit_span(SimpleSpanProcessor(CountingSpanExporter(JsonlSpanExporter(writer), stats)))
    assert stats.snapshot()["spans_failed"] == 1 and stats.snapshot()["spans_exported"] == 0
    assert writer.write_errors == 1 and isinstance(writer.last_error, OSError)


def test_jsonl_torn_line_is_terminated(tmp_path):
    """A write cut short by the file size limit (as by a full disk) leaves one bad line, not two."""
    path = tmp_path / "t.jsonl"
    writer = JsonlWriter(path)
    writer.write_line('{"a":1}')
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of the signal
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 5, old_limit[1]))
        with pytest.raises(OSError):
            writer.write_line('{"b":"long enough to be cut"}')
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    writer.write_line('{"c":3}')
    assert path.read_text().splitlines() == ['{"a":1}', '{"b":', '{"c":3}']
    assert (writer.lines_written, writer.write_errors) == (2, 1)


@pytest.mark.parametrize("protocol,receiver_cls", PROTOCOLS)
def test_receiver_outage_counts_failures_and_recovers(protocol, receiver_cls, tmp_path):
    with receiver_cls() as rx:
        rx.fail = True
        # A short timeout ends the SDK's retry loop after the first attempt (its first backoff is ~1 s).
        exporters = build_exporters(str(tmp_path / "t.jsonl"), rx.endpoint, protocol, otlp_timeout_s=0.5)
        processor = batch_processor(exporters)
        emit_span(processor, shutdown=False)
        emit_counter(exporters.metric_exporters).shutdown()
        snap = exporters.stats.snapshot()
        assert rx.rejected >= 2 and rx.spans() == []
        assert (snap["spans_failed"], snap["spans_exported"]) == (1, 0)
        assert snap["metrics_exports_failed"] >= 1  # the OTLP one; the JSONL one succeeded
        assert snap["metrics_exports_ok"] >= 1

        rx.fail = False
        emit_span(processor)
        assert len(rx.wait_for_spans(1)) == 1
        assert exporters.stats.snapshot()["spans_exported"] == 1
    # JSONL got both batches: fan-out does not stop at the failing sink.
    assert sum('"resourceSpans"' in line for line in (tmp_path / "t.jsonl").read_text().splitlines()) == 2


class BlockedExporter(SpanExporter):
    """A sink stuck in export() until released: the batch worker holds its batch, the queue fills."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.names: list[str] = []

    def export(self, spans):
        self.entered.set()
        assert self.release.wait(10)
        self.names += [s.name for s in spans]
        return SpanExportResult.SUCCESS


def test_full_queue_drops_are_counted_exactly():
    stats, sink = ExportStats(), BlockedExporter()
    processor = CountingBatchSpanProcessor(
        CountingSpanExporter(sink, stats), stats, max_queue_size=4, schedule_delay_ms=10, max_export_batch_size=1
    )
    provider = TracerProvider(resource=RESOURCE)
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("t")
    try:
        tracer.start_span("s0").end()
        assert sink.entered.wait(5)  # s0 is out of the queue and inside the blocked export
        for i in range(1, 8):  # s1..s4 fill the queue, s5..s7 each push out the oldest queued span
            tracer.start_span(f"s{i}").end()
        assert stats.snapshot()["spans_dropped_queue"] == 3
    finally:
        sink.release.set()
    provider.force_flush(5000)
    provider.shutdown()
    assert sink.names == ["s0", "s4", "s5", "s6", "s7"]
    assert stats.snapshot() == {
        "spans_exported": 5,
        "spans_failed": 0,
        "spans_dropped_queue": 3,
        "metrics_exports_ok": 0,
        "metrics_exports_failed": 0,
    }


class StaticExporter(SpanExporter):
    def __init__(self, result):
        self.result, self.calls = result, 0

    def export(self, spans):
        self.calls += 1
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


@pytest.mark.parametrize("results,expected", [
    ((SpanExportResult.SUCCESS, SpanExportResult.SUCCESS), SpanExportResult.SUCCESS),
    ((SpanExportResult.FAILURE, SpanExportResult.SUCCESS), SpanExportResult.FAILURE),
    ((SpanExportResult.SUCCESS, SpanExportResult.FAILURE), SpanExportResult.FAILURE),
    ((RuntimeError("sink bug"), SpanExportResult.SUCCESS), SpanExportResult.FAILURE),
])
def test_fan_out_needs_every_sink(results, expected):
    sinks = [StaticExporter(r) for r in results]
    stats = ExportStats()
    emit_span(SimpleSpanProcessor(CountingSpanExporter(MultiSpanExporter(sinks), stats)))
    assert [s.calls for s in sinks] == [1, 1]
    ok = expected is SpanExportResult.SUCCESS
    assert (stats.snapshot()["spans_exported"], stats.snapshot()["spans_failed"]) == ((1, 0) if ok else (0, 1))


def test_counting_turns_an_exception_into_a_failure():
    stats = ExportStats()
    exporter = CountingSpanExporter(StaticExporter(OSError("boom")), stats)
    emit_span(SimpleSpanProcessor(exporter))
    assert stats.snapshot()["spans_failed"] == 1


def test_queue_full_warning_is_rate_limited():
    f = _RateLimitFilter("Queue full", interval_s=60)
    rec = lambda msg: logging.LogRecord("x", logging.WARNING, __file__, 1, msg, ("Span",), None)  # noqa: E731
    assert [f.filter(rec("Queue full, dropping %s.")) for _ in range(5)] == [True, False, False, False, False]
    assert f.filter(rec("Exception while exporting %s."))
    assert f.suppressed == 4


def test_console_line_and_describe():
    out = io.StringIO()
    emit_span(SimpleSpanProcessor(ConsoleSpanExporter(out)))
    [line] = out.getvalue().splitlines(keepends=True)
    assert line.startswith(f"reclaim_stall trace={TRACE_ID:032x} span=")
    assert line.endswith(" 2.500ms hostagent.pid=4242 hostagent.comm=python3 hostagent.reclaim_stall_ns=1234567\n")
    exporters = build_exporters("/var/lib/mcp-agent/telemetry.jsonl", "http://127.0.0.1:4317", "grpc", out)
    assert exporters.describe() == [
        "jsonl: /var/lib/mcp-agent/telemetry.jsonl (spans), /var/lib/mcp-agent/telemetry.metrics.jsonl (metrics)",
        "otlp grpc: http://127.0.0.1:4317",
        "console: StringIO (spans, metric summaries)",
    ]
    with pytest.raises(ValueError, match="http/json"):
        build_exporters(None, "http://127.0.0.1:4318", "http/json")


def test_direct_span_json_equals_the_protobuf_path():
    """spans_json_line builds OTLP/JSON straight from SDK spans for speed; it must stay byte-identical to
    the reference path (the SDK's OTLP encoder, protobuf's json_format, ids as hex), so an SDK or
    protobuf upgrade that changes either side fails here."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags, set_span_in_context

    from mcp_hostagent.exporters.jsonl import otlp_json_line, spans_json_line

    mem = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(mem))
    tr = tp.get_tracer("t", "1")
    parent = set_span_in_context(NonRecordingSpan(SpanContext(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7,
                                                              is_remote=True, trace_flags=TraceFlags(1))))
    values = [1, -2**63, 2**63 - 1, 0.5, float("inf"), True, "ascii", "ünïcode \x1b[2J \\ \"q\"", "",
              [1, 2], ["a", "b"], [True, False], [0.25]]
    for i, v in enumerate(values):
        s = tr.start_span(f"s{i}", context=parent if i % 2 else None, start_time=1_000 + i,
                          attributes={"k": v, "pid": i, "": "empty key"},
                          links=[Link(SpanContext(0xAB, 0xCD, is_remote=True), {"l": "x"})] if i % 3 == 0 else None)
        s.add_event("e", {"n": i}, timestamp=1_500 + i)
        if i % 4 == 0:
            s.set_status(Status(StatusCode.ERROR, "bad"))
        s.end(end_time=2_000 + i)
    spans = mem.get_finished_spans()
    assert spans_json_line(spans) == otlp_json_line(encode_spans(spans))
    for one in spans:
        assert spans_json_line([one]) == otlp_json_line(encode_spans([one]))


@pytest.mark.parametrize("overrides", [
    {"export.otlp_endpoint": "http://127.0.0.1:9", "export.otlp_protocol": "grpc", "export.console": True},
    {"export.otlp_endpoint": "http://127.0.0.1:9", "export.otlp_protocol": "http/protobuf",
     "export.prometheus_listen": "127.0.0.1:0"},
])
def test_modules_imported_behind_the_compile_are_the_ones_the_start_uses(overrides, tmp_path):
    """`mcp-agent run` imports exporters.modules_for(cfg) in a thread while the BPF unit compiles; a
    fresh interpreter shows the agent's core leaves OpenTelemetry alone, that the thread imports every
    module listed, and that from_config needs no OTLP module the list misses."""
    code = f"""
import sys
from mcp_hostagent import config as C
import mcp_hostagent.core.agent
assert not [m for m in sys.modules if m.startswith(("opentelemetry", "google.protobuf"))], "core imports OTel"
from mcp_hostagent import exporters
from mcp_hostagent.core import imports_behind
cfg = C.load_config(None, env={{}}, overrides={dict(overrides, **{"export.jsonl_path": str(tmp_path / "s.jsonl")})!r})
mods = exporters.modules_for(cfg)
imports_behind.start("mcp_hostagent.telemetry.otel", *mods)
imports_behind.wait()
missing = [m for m in mods if m not in sys.modules]
assert not missing, missing
before = {{m for m in sys.modules if m.startswith(("opentelemetry.exporter", "mcp_hostagent.exporters"))}}
ex = exporters.from_config(cfg)
ex.close()
after = {{m for m in sys.modules if m.startswith(("opentelemetry.exporter", "mcp_hostagent.exporters"))}}
assert after == before, sorted(after - before)
print("ok", len(mods))
"""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")})
    assert r.returncode == 0 and r.stdout.startswith("ok "), r.stderr

