"""telemetry/otel.py: the capabilities' plain data (telemetry/spec.py) -> SDK spans, through the real
SDK into memory: parent, links to spans opened under a key (with the linking span's events carrying
the linked ids), children, error status, times through the one timebase; and the metric rows."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from mcp_hostagent.core.capability import Evidence
from mcp_hostagent.core.timebase import Timebase
from mcp_hostagent.exporters import Exporters
from mcp_hostagent.exporters.counting import CountingSpanExporter, ExportStats
from mcp_hostagent.core.traceparent import parse
from mcp_hostagent.telemetry.otel import Telemetry
from mcp_hostagent.telemetry.spec import EventSpec, Instrument, LinkSpec, SpanSpec

TP = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
OFFSET = 1_700_000_000 * 10**9


def telemetry():
    memory, stats = InMemorySpanExporter(), ExportStats()
    tel = Telemetry(service_name="t", exporters=Exporters(CountingSpanExporter(memory, stats), [], stats),
                    timebase=Timebase(offset_ns=OFFSET), schedule_delay_ms=10)
    return tel, memory


def finished(tel, memory):
    tel.tracer_provider.force_flush(2000)
    return {s.name: s for s in memory.get_finished_spans()}


def test_span_with_parent_children_error_and_wall_times():
    tel, memory = telemetry()
    child = SpanSpec("child", 1_500, 1_700, {"k": 1})
    tel.span(SpanSpec("req", 1_000, 2_000, {"a": "x", "gone": None}, parent=parse(TP), children=(child,),
                      events=(EventSpec("ev", 1_200, {"e": 2, "none": None}),), error="request ended: expired"))
    spans = finished(tel, memory)
    req, ch = spans["req"], spans["child"]
    assert (req.start_time, req.end_time) == (OFFSET + 1_000, OFFSET + 2_000)
    assert dict(req.attributes) == {"a": "x"}  # None is left out, never exported as a bad value
    assert req.context.trace_id == 0x4bf92f3577b34da6a3ce929d0e0e4736 and req.parent.span_id == 0x00f067aa0ba902b7
    assert req.status.status_code == StatusCode.ERROR and req.status.description == "request ended: expired"
    assert [(e.name, dict(e.attributes), e.timestamp) for e in req.events] == [("ev", {"e": 2}, OFFSET + 1_200)]
    assert ch.parent.span_id == req.context.span_id and ch.context.trace_id == req.context.trace_id
    assert (ch.start_time, ch.end_time) == (OFFSET + 1_500, OFFSET + 1_700)


def test_links_to_an_opened_span_carry_its_ids_in_an_event_and_unknown_keys_are_skipped():
    tel, memory = telemetry()
    tel.open(("storm", 1), SpanSpec("storm", 100, None, {"scope": "host"}))
    link = LinkSpec(("storm", 1), {"hostagent.link.type": "reclaim_storm"}, EventSpec("hostagent.reclaim_storm", 900, {"s": 1}),
                    ("tid", "sid"))
    gone = LinkSpec(("storm", 2), {"x": 1}, EventSpec("never", 900))
    tel.span(SpanSpec("req", 800, 1_000, {}, links=(link, gone)))
    tel.close(("storm", 1), {"windows": 3}, 1_100)
    spans = finished(tel, memory)
    storm, req = spans["storm"], spans["req"]
    assert dict(storm.attributes) == {"scope": "host", "windows": 3} and storm.end_time == OFFSET + 1_100
    assert [(ln.context.span_id, dict(ln.attributes)) for ln in req.links] == \
        [(storm.context.span_id, {"hostagent.link.type": "reclaim_storm"})]
    (ev,) = req.events
    assert ev.name == "hostagent.reclaim_storm" and ev.timestamp == OFFSET + 900
    assert dict(ev.attributes) == {"s": 1, "tid": f"{storm.context.trace_id:032x}", "sid": f"{storm.context.span_id:016x}"}
    tel.forget(("storm", 1))
    tel.span(SpanSpec("later", 800, 1_000, {}, links=(link,)))
    assert not finished(tel, memory)["later"].links  # forgotten: no link to a span the collector may have aged out


def test_events_on_an_open_span_and_close_now():
    tel, memory = telemetry()
    tel.open("k", SpanSpec("ep", 100, None, {}))
    tel.event("k", "upd", 150, {"a": 1, "b": None})
    assert not finished(tel, memory)  # open: not exported yet
    tel.close("k", {"unfinished": True}, None)
    ep = finished(tel, memory)["ep"]
    assert [(e.name, dict(e.attributes)) for e in ep.events] == [("upd", {"a": 1})] and ep.attributes["unfinished"]
    tel.event("k", "late", 200, {})  # closed: no span to add it to, and no error
    tel.close("k", {}, None)
    assert [s.name for s in memory.get_finished_spans()] == ["ep"]


def test_published_rows_and_read_instruments():
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    tel, _ = telemetry()
    reader = InMemoryMetricReader()
    from opentelemetry.sdk.metrics import MeterProvider

    tel.meter_provider = MeterProvider(metric_readers=[reader])
    tel._meter = tel.meter_provider.get_meter("t")
    state = {"n": 5}
    tel.declare([Instrument("pub", "gauge"), Instrument("read", "counter", read=lambda: [(state["n"], {"x": 1})]),
                 Instrument("h", "histogram", "ms")])
    tel.publish({"pub": [(1.5, {"a": "b"}), (None, {"a": "gone"})]})
    tel.record("h", 12.0, {"r": "marked"})
    state["n"] = 7

    def points():
        data = reader.get_metrics_data()
        return {m.name: [(p.attributes, getattr(p, "value", getattr(p, "sum", None))) for p in m.data.data_points]
                for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}

    got = points()
    assert got["pub"] == [({"a": "b"}, 1.5)]  # None values are left out
    assert got["read"] == [({"x": 1}, 7)]  # read when collected, not when declared
    assert got["h"] == [({"r": "marked"}, 12.0)]
    tel.publish({"pub": [(2.0, {"a": "b"})]})
    assert points()["pub"] == [({"a": "b"}, 2.0)]


def test_evidence_merges_in_order():
    a = Evidence({"x": 1, "y": 1}, (LinkSpec("a", {}),), (EventSpec("e1", 1),))
    b = Evidence({"y": 2}, (LinkSpec("b", {}),), (EventSpec("e2", 2),))
    m = a + b
    assert m.attributes == {"x": 1, "y": 2} and [ln.key for ln in m.links] == ["a", "b"]
    assert [e.name for e in m.events] == ["e1", "e2"]
