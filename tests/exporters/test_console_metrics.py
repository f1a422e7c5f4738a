"""`--console` metrics: the real SDK (MeterProvider + PeriodicExportingMetricReader) feeding
ConsoleMetricExporter, as build_exporters wires it: per export one header line, then one bounded
summary line per metric name (not per point)."""

from __future__ import annotations

import io
import re

from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

from mcp_hostagent.exporters import ConsoleMetricExporter, ConsoleSpanExporter, CountingMetricExporter, build_exporters

HEADER = re.compile(r"-- metrics \d\d:\d\d:\d\d: (\d+) names, (\d+) points --\Z")


def provider(exporter):
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)  # exports on flush only
    return MeterProvider(metric_readers=[reader])


def exports(text: str) -> list[list[str]]:
    """The printed exports: each a header line and its metric lines."""
    out: list[list[str]] = []
    for ln in text.splitlines():
        if HEADER.match(ln):
            out.append([ln])
        else:
            assert out, f"a line before any header: {ln!r}"
            out[-1].append(ln)
    return out


def by_name(lines: list[str]) -> dict[str, str]:
    return {ln.split(" ", 1)[0]: ln for ln in lines[1:]}


def test_console_is_wired_for_metrics_and_counted():
    out = io.StringIO()
    ex = build_exporters(None, None, console_stream=out)
    assert ex.describe() == ["console: StringIO (spans, metric summaries)"]
    assert [type(e) for e in ex.span_exporter.inner.exporters] == [ConsoleSpanExporter]  # spans as before
    [m] = ex.metric_exporters
    assert isinstance(m, CountingMetricExporter) and isinstance(m.inner, ConsoleMetricExporter)
    mp = provider(m)
    mp.get_meter("t").create_counter("hostagent.agent.spans.exported").add(3)
    mp.force_flush()
    [[head, line]] = exports(out.getvalue())
    assert HEADER.match(head).groups() == ("1", "1")
    assert line == "hostagent.agent.spans.exported counter 1 pt sum=3"
    assert ex.stats.snapshot()["metrics_exports_ok"] >= 1
    mp.shutdown()


def test_one_summary_line_per_metric_name():
    out = io.StringIO()
    mp = provider(ConsoleMetricExporter(out, width=240))
    meter = mp.get_meter("t")
    launches = meter.create_counter("hostagent.process.cuda.launches", unit="{launch}")
    for pid in range(1, 6):
        launches.add(pid * 100, {"process.pid": pid, "process.executable.name": "python3"})
    temps = {0: 41.5, 1: 77.0}
    meter.create_observable_gauge("hostagent.gpu.temperature", [lambda o: [
        Observation(t, {"hostagent.gpu.index": i}) for i, t in temps.items()]], unit="Cel")
    meter.create_observable_gauge("hostagent.agent.bpf.compile.duration", [lambda o: [Observation(1.25)]], unit="s")
    hist = meter.create_histogram("hostagent.request.duration", unit="ms")
    for v in (1.0, 2.0, 7.0):
        hist.record(v, {"hostagent.route": "/v1"})
    updown = meter.create_up_down_counter("hostagent.requests.open")
    updown.add(4)
    updown.add(-1)
    mp.force_flush()
    launches.add(10, {"process.pid": 2, "process.executable.name": "python3"})
    mp.force_flush()

    first, second = exports(out.getvalue())
    assert HEADER.match(first[0]).groups() == ("5", str(5 + 2 + 1 + 1 + 1))
    assert len(first) == 1 + 5  # one line per name, 10 points
    lines = by_name(first)
    assert list(lines) == sorted(lines)
    assert lines["hostagent.process.cuda.launches"] == (
        "hostagent.process.cuda.launches counter 5 pts sum=1500 [{launch}] top: "
        "500 {process.pid=5,executable.name=python3} 400 {process.pid=4,executable.name=python3} "
        "300 {process.pid=3,executable.name=python3} +2")
    assert lines["hostagent.gpu.temperature"] == (
        "hostagent.gpu.temperature gauge 2 pts min=41.5 max=77 [Cel] top: 77 {gpu.index=1} 41.5 {gpu.index=0}")
    assert lines["hostagent.agent.bpf.compile.duration"] == "hostagent.agent.bpf.compile.duration gauge 1 pt value=1.25 [s]"
    assert lines["hostagent.request.duration"] == (
        "hostagent.request.duration histogram 1 pt count=3 sum=10 [ms] top: 10 {hostagent.route=/v1}")
    assert lines["hostagent.requests.open"] == "hostagent.requests.open updown 1 pt sum=3"
    # the next interval: a counter's total and its change since the last export
    assert by_name(second)["hostagent.process.cuda.launches"].startswith(
        "hostagent.process.cuda.launches counter 5 pts sum=1510 (+10) [{launch}] top: 500 ")
    mp.shutdown()


def test_lines_are_bounded_and_printable():
    out = io.StringIO()
    mp = provider(ConsoleMetricExporter(out, width=100))
    c = mp.get_meter("t").create_counter("hostagent.process.faults")
    for i in range(200):
        c.add(i + 1, {"process.command_line": "python3 " + "x" * 300 + str(i), "process.pid": i})
    c.add(1, {"process.executable.name": "evil\x1b[2J\n", "process.pid": 999})
    mp.force_flush()
    [[head, line]] = exports(out.getvalue())
    assert HEADER.match(head).groups() == ("1", "201")
    assert len(line) == 100 and line.endswith("…"), line
    assert line.startswith("hostagent.process.faults counter 201 pts sum=20101 top: 200 {")
    assert "\x1b" not in out.getvalue()
    out.truncate(0)
    out.seek(0)
    mp2 = provider(ConsoleMetricExporter(out))
    mp2.get_meter("t").create_counter("hostagent.x").add(1, {"process.executable.name": "evil\x1b[2J\n"})
    mp2.force_flush()
    assert "{executable.name=evil\\x1b[2J\\x0a}" in out.getvalue()
    # at the default width, as many of the largest points as fit, and how many are left out
    out.truncate(0)
    out.seek(0)
    mp3 = provider(ConsoleMetricExporter(out))
    c3 = mp3.get_meter("t").create_counter("hostagent.process.cuda.launches", unit="{launch}")
    for pid in range(1, 6):
        c3.add(pid * 100, {"process.pid": pid, "process.executable.name": "python3"})
    mp3.force_flush()
    [[_, line]] = exports(out.getvalue())
    assert line == ("hostagent.process.cuda.launches counter 5 pts sum=1500 [{launch}] top: "
                    "500 {process.pid=5,executable.name=python3} +4")
    mp3.shutdown()
    mp.shutdown()
    mp2.shutdown()


class Broken(io.StringIO):
    def write(self, s):
        raise OSError(5, "Input/output error")


def test_a_broken_stream_is_a_failed_export_not_an_exception():
    from mcp_hostagent.exporters import ExportStats

    stats = ExportStats()
    mp = provider(CountingMetricExporter(ConsoleMetricExporter(Broken()), stats))
    mp.get_meter("t").create_counter("hostagent.x").add(1)
    mp.force_flush()
    assert stats.snapshot()["metrics_exports_failed"] >= 1
    mp.shutdown()


def test_all_zero_points_are_counted_not_listed():
    out = io.StringIO()
    mp = provider(ConsoleMetricExporter(out))
    lost = mp.get_meter("t").create_counter("hostagent.agent.events.lost")
    for where in ("kernel", "user"):
        lost.add(0, {"hostagent.where": where})
    mp.force_flush()
    assert exports(out.getvalue())[0][1:] == ["hostagent.agent.events.lost counter 2 pts sum=0"]
    mp.shutdown()


def test_a_kernel_histogram_without_a_sum_shows_its_count_not_a_zero_sum():
    from opentelemetry.sdk.metrics.export import AggregationTemporality, Histogram, Metric

    from mcp_hostagent.exporters.console import format_metric
    from mcp_hostagent.telemetry.otel import log2_histogram_point
    from mcp_hostagent.telemetry.spec import Log2Buckets

    points = [log2_histogram_point(Log2Buckets({21: 3, 22: 1}), {"hostagent.reclaim.kind": "direct"}, 0, 1),
              log2_histogram_point(Log2Buckets({12: 9}), {"hostagent.reclaim.kind": "memcg"}, 0, 1)]
    m = Metric("hostagent.reclaim.stall.duration", "", "s", Histogram(points, AggregationTemporality.CUMULATIVE))
    assert format_metric(m) == ("hostagent.reclaim.stall.duration histogram 2 pts count=13 [s] "
                                "top: 9 {reclaim.kind=memcg} 4 {reclaim.kind=direct}")
