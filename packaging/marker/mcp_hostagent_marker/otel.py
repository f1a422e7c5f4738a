"""An OpenTelemetry span processor marking every SERVER span for mcp-agent: one line where the
application sets up its tracer provider.

    provider.add_span_processor(MarkServerSpans())

Each SERVER span's start marks a begin on the thread starting it, with the span's own context as
the traceparent (the agent's request span becomes its child in Tempo); its end marks the end. Needs
opentelemetry-sdk, which an application using this already has (`pip install
mcp-hostagent-marker[otel]`); the marker itself needs nothing.
"""

from __future__ import annotations

from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.trace import SpanKind

from . import begin, end


class MarkServerSpans(SpanProcessor):
    def on_start(self, span, parent_context=None) -> None:
        if span.kind is not SpanKind.SERVER:
            return
        ctx = span.get_span_context()
        begin(ctx.span_id | 1, f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}")

    def on_end(self, span) -> None:
        if span.kind is SpanKind.SERVER:
            end(span.get_span_context().span_id | 1)

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
