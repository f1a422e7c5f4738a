"""Console exporter: one compact human line per span, for `--console` and debugging.

Attributes are printed as given: the agent sanitizes them before they become span attributes.
"""

from __future__ import annotations

import sys
from typing import IO, Sequence

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
