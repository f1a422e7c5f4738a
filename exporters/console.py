"""Console exporters, for `--console` and debugging: one compact human line per span, and per metric
export interval one summary line per metric name (ConsoleMetricExporter).

Span attributes are printed as given: the agent sanitizes them before they become span attributes.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Sequence

from opentelemetry.sdk.metrics.export import (AggregationTemporality, ExponentialHistogram, Histogram, MetricExporter,
                                              MetricExportResult, MetricsData)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

MAX_ATTRS = 6


def format_span(span: ReadableSpan, max_attrs: int = MAX_ATTRS) -> str:
    """`name trace=<32hex> span=<16hex> 12.345ms k=v ...` (first `max_attrs` attributes, then `+N`)."""
    ctx = span.context
    dur = f"{(span.end_time - span.start_time) / 1e6:.3f}ms" if span.end_time and span.start_time else "?ms"
    parts = [span.name, f"trace={ctx.trace_id:032x}", f"span={ctx.span_id:016x}", dur]
    attrs = list((span.attributes or {}).items())
    parts += [f"{k}={v}" for k, v in attrs[:max_attrs]]
    if len(attrs) > max_attrs:
        parts.append(f"+{len(attrs) - max_attrs}")
    if not span.status.is_ok:
        parts.append(f"status={span.status.status_code.name}")
    return " ".join(parts)


class ConsoleSpanExporter(SpanExporter):
    """Writes `format_span` lines to `stream` (stdout, looked up at export time, when None)."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        out = self.stream or sys.stdout
        try:
            out.write("".join(format_span(s) + "\n" for s in spans))
            out.flush()
        except (OSError, ValueError):  # ValueError: write to a closed stream
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


# ---- metrics: one summary line per metric name and export interval ----

TOP_POINTS = 3  # largest points shown per metric
LINE_WIDTH = 160  # characters per line, at most


def _num(v) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    return str(v) if isinstance(v, int) else f"{v:.4g}"


def _printable(s: str) -> str:
    """Control characters as \\xNN: a process name must not move the terminal's cursor."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in s)


def _key(k: str) -> str:
    """An attribute key, shortened to its last two dotted parts (process.pid, probe.state)."""
    return ".".join(k.split(".")[-2:])


def _attrs(attrs) -> str:
    return "{" + ",".join(f"{_key(k)}={_printable(str(v))}" for k, v in (attrs or {}).items()) + "}"


def _point_value(p) -> float:
    """A point's size: its value, a histogram's sum, or the count of a histogram without one (the
    kernel's log2 histograms keep no sum)."""
    v = getattr(p, "value", None)
    if v is not None:
        return v
    s = getattr(p, "sum", None)
    return s if s is not None else (getattr(p, "count", 0) or 0)


def _fit(line: str, width: int) -> str:
    return line if len(line) <= width else line[: width - 1] + "…"


def format_metric(metric, width: int = LINE_WIDTH, top: int = TOP_POINTS, prev: float | None = None) -> str:
    """`name kind N pts sum=S (+D) [unit] top: V {k=v,...} V {...} +M`, at most `width` characters.
    kind: counter (monotonic sum), updown, gauge or histogram; gauges show min and max, histograms count
    and sum; `prev`: a counter's sum at the last export, for the change since (+D). top: the largest
    points (as many of `top` as fit) with their attributes, keys cut to their last two dotted parts;
    left out when every point is zero."""
    data = metric.data
    points = list(getattr(data, "data_points", ()) or ())
    if hasattr(data, "is_monotonic"):
        kind = "counter" if data.is_monotonic else "updown"
    elif isinstance(data, (Histogram, ExponentialHistogram)):
        kind = "histogram"
    else:
        kind = "gauge"
    parts = [metric.name, kind, f"{len(points)} pt" + ("s" if len(points) != 1 else "")]
    values = [_point_value(p) for p in points]
    if kind == "histogram":
        sums = [p.sum for p in points if getattr(p, "sum", None) is not None]  # none: not "sum=0"
        parts.append(f"count={sum(getattr(p, 'count', 0) for p in points)}" + (f" sum={_num(sum(sums))}" if sums else ""))
    elif kind == "gauge" and values:
        lo, hi = min(values), max(values)
        parts.append(f"value={_num(hi)}" if lo == hi else f"min={_num(lo)} max={_num(hi)}")
    elif values:
        total = sum(values)
        parts.append(f"sum={_num(total)}" + (f" ({'+' if total >= prev else ''}{_num(total - prev)})"
                                             if prev is not None else ""))
    if metric.unit and metric.unit not in ("1", ""):
        parts.append(f"[{_printable(metric.unit)}]")
    line = " ".join(parts)
    if any(values) and (len(points) > 1 or points[0].attributes):  # all zero: nothing to point at
        shown: list[str] = []  # the largest points, as many of `top` as fit (at least one, cut if need be)
        for p in sorted(points, key=_point_value, reverse=True)[:top]:
            item = f"{_num(_point_value(p))} {_attrs(p.attributes)}"
            more = len(points) - len(shown) - 1
            if shown and len(f"{line} top: {' '.join(shown + [item])}" + (f" +{more}" if more else "")) > width:
                break
            shown.append(item)
        line += " top: " + " ".join(shown) + (f" +{len(points) - len(shown)}" if len(points) > len(shown) else "")
    return _fit(line, width)


class ConsoleMetricExporter(MetricExporter):
    """A compact human summary per export interval on `stream` (stdout, looked up at export time, when
    None): a header line, then one `format_metric` line per metric name (sorted), not one per point.
    Cumulative temporality (as the JSONL file): counters show their totals and the change since the
    last export."""

    def __init__(self, stream: IO[str] | None = None, width: int = LINE_WIDTH, top: int = TOP_POINTS) -> None:
        super().__init__()
        self.stream, self.width, self.top = stream, width, top
        self._prev: dict[str, float] = {}  # counter name -> its sum at the last export

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        metrics = {}
        for rm in metrics_data.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    metrics.setdefault(m.name, m)  # one line per name
        points = sum(len(getattr(m.data, "data_points", ()) or ()) for m in metrics.values())
        stamp = time.strftime("%H:%M:%S")
        lines = [_fit(f"-- metrics {stamp}: {len(metrics)} names, {points} points --", self.width)]
        for name in sorted(metrics):
            m = metrics[name]
            lines.append(format_metric(m, self.width, self.top, self._prev.get(name)))
            if getattr(m.data, "is_monotonic", False) and \
                    m.data.aggregation_temporality == AggregationTemporality.CUMULATIVE:
                self._prev[name] = sum(_point_value(p) for p in m.data.data_points)
        out = self.stream or sys.stdout
        try:
            out.write("".join(ln + "\n" for ln in lines))
            out.flush()
        except (OSError, ValueError):  # ValueError: write to a closed stream
            return MetricExportResult.FAILURE
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        pass
