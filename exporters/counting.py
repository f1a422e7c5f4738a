"""Export accounting: wrappers that count what reached a sink, what failed and what the queue dropped.

The counts are what the agent reports as its own health metrics and in the exit summary, so a lost
span is always a number somewhere, never only a log line.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Sequence

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from ..redact import redact_text

_log = logging.getLogger(__name__)

# SDK 1.45 logs "Queue full, dropping Span." on this logger for every dropped span.
_SDK_BATCH_LOGGER = "opentelemetry.sdk._shared_internal"


class ExportStats:
    """Thread-safe export counters; `snapshot()` is the only way to read them."""

    FIELDS = ("spans_exported", "spans_failed", "spans_dropped_queue", "metrics_exports_ok", "metrics_exports_failed")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.FIELDS, 0)

    def add(self, field: str, n: int = 1) -> None:
        if field not in self._counts:
            raise KeyError(f"unknown export counter {field!r}")
        with self._lock:
            self._counts[field] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class CountingSpanExporter(SpanExporter):
    """Counts spans per export result; an exception from `inner` is a FAILURE, never propagated."""

    def __init__(self, inner: SpanExporter, stats: ExportStats) -> None:
        self.inner = inner
        self.stats = stats

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception:  # noqa: BLE001 - a broken sink must not kill the batch worker
            _log.exception("span exporter %s raised", type(self.inner).__name__)
            result = SpanExportResult.FAILURE
        ok = result is SpanExportResult.SUCCESS
        self.stats.add("spans_exported" if ok else "spans_failed", len(spans))
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class CountingMetricExporter(MetricExporter):
    """Counts metric export calls per result; carries the inner exporter's temporality/aggregation."""

    def __init__(self, inner: MetricExporter, stats: ExportStats) -> None:
        # PeriodicExportingMetricReader reads these two attributes from the exporter it is given.
        super().__init__(
            preferred_temporality=getattr(inner, "_preferred_temporality", None),
            preferred_aggregation=getattr(inner, "_preferred_aggregation", None),
        )
        self.inner = inner
        self.stats = stats

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        try:
            result = self.inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception:  # noqa: BLE001
            _log.exception("metric exporter %s raised", type(self.inner).__name__)
            result = MetricExportResult.FAILURE
        ok = result is MetricExportResult.SUCCESS
        self.stats.add("metrics_exports_ok" if ok else "metrics_exports_failed")
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self.inner.force_flush(timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        self.inner.shutdown(timeout_millis=timeout_millis, **kwargs)


class MultiSpanExporter(SpanExporter):
    """Fan-out to every exporter in order; SUCCESS only if all of them succeed.

    Sinks run one after another in the batch worker, so a slow OTLP endpoint delays the next sink by
    at most its own timeout; every sink still sees every batch.
    """

    def __init__(self, exporters: Sequence[SpanExporter]) -> None:
        self.exporters = list(exporters)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        ok = True
        for exporter in self.exporters:
            try:
                ok &= exporter.export(spans) is SpanExportResult.SUCCESS
            except Exception:  # noqa: BLE001
                _log.exception("span exporter %s raised", type(exporter).__name__)
                ok = False
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        for exporter in self.exporters:
            try:
                exporter.shutdown()
            except Exception:  # noqa: BLE001
                _log.exception("shutdown of span exporter %s raised", type(exporter).__name__)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return all([e.force_flush(timeout_millis) for e in self.exporters])


class _RateLimitFilter(logging.Filter):
    """Lets one record whose message starts with `prefix` through per `interval_s`; others pass untouched."""

    def __init__(self, prefix: str, interval_s: float) -> None:
        super().__init__()
        self.prefix, self.interval_s = prefix, interval_s
        self._next_ok = 0.0
        self.suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.prefix):
            return True
        now = time.monotonic()
        if now < self._next_ok:
            self.suppressed += 1
            return False
        self._next_ok = now + self.interval_s
        return True


class _ExportErrorFilter(_RateLimitFilter):
    """The OTLP exporters log a warning per retry and an error per failed batch: during a collector
    outage, a line a second. One per interval gets through, saying how many were held back since."""

    def __init__(self, interval_s: float) -> None:
        super().__init__(("Transient error", "Failed to export"), interval_s)
        self._held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        before = self.suppressed
        ok = super().filter(record)
        if self.suppressed > before:
            self._held += 1
        elif ok and self._held and str(record.msg).startswith(self.prefix) and isinstance(record.args, tuple):
            record.msg = (f"{record.msg} (and %d similar export errors in the last %.0f s, not logged; "
                          "lost spans are counted in hostagent.agent.spans.dropped)")
            record.args = record.args + (self._held, self.interval_s)
            self._held = 0
        return ok


class _RedactFilter(logging.Filter):
    """The exporters log their endpoint (gRPC: the URL's netloc, `user:password@host:port`) and
    gRPC's error details name the target too: a password in the endpoint URL is replaced by ***."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact_text(record.msg)
        if isinstance(record.args, tuple):
            args = []
            for a in record.args:
                text = a if isinstance(a, str) else str(a) if not isinstance(a, (int, float)) else None
                args.append(a if text is None or redact_text(text) == text else redact_text(text))
            record.args = tuple(args)
        return True


_redact_filter = _RedactFilter()

# the loggers of the SDK's OTLP exporters (gRPC: one for both signals)
_OTLP_LOGGERS = ("opentelemetry.exporter.otlp.proto.grpc.exporter",
                 "opentelemetry.exporter.otlp.proto.http.trace_exporter",
                 "opentelemetry.exporter.otlp.proto.http.metric_exporter")
_export_error_filters: dict[str, _ExportErrorFilter] = {}


def install_export_error_filters(interval_s: float = 30.0) -> None:
    for name in _OTLP_LOGGERS:
        logging.getLogger(name).addFilter(_redact_filter)  # (the same filter is added once only)
        if name not in _export_error_filters:
            _export_error_filters[name] = _ExportErrorFilter(interval_s)
            logging.getLogger(name).addFilter(_export_error_filters[name])


_queue_full_filter: _RateLimitFilter | None = None


def _install_queue_full_filter(interval_s: float = 60.0) -> None:
    global _queue_full_filter
    if _queue_full_filter is None:
        _queue_full_filter = _RateLimitFilter("Queue full", interval_s)
        logging.getLogger(_SDK_BATCH_LOGGER).addFilter(_queue_full_filter)


class CountingBatchSpanProcessor(BatchSpanProcessor):
    """SDK BatchSpanProcessor that counts spans dropped because its queue was full.

    SDK 1.45's BatchProcessor.emit only logs a warning when the queue is full and then lets the
    bounded deque drop the oldest span. We look at the queue before emitting; the attributes are
    SDK internals, read with getattr, so a future SDK that renames them counts 0 instead of failing.
    A span the worker takes out between our check and the append can make the count one high per
    such race; producers are serialised so two of them cannot hide a drop from each other.
    """

    def __init__(
        self,
        exporter: SpanExporter,
        stats: ExportStats,
        max_queue_size: int = 2048,
        schedule_delay_ms: float = 5000,
        max_export_batch_size: int = 512,
    ) -> None:
        super().__init__(
            exporter,
            max_queue_size=max_queue_size,
            schedule_delay_millis=schedule_delay_ms,
            # the SDK refuses a batch larger than the queue (export.max_queue_size may be as small as 16)
            max_export_batch_size=min(max_export_batch_size, max_queue_size),
        )
        self.stats = stats
        self._emit_lock = threading.Lock()
        _install_queue_full_filter()

    def _queue_full(self) -> bool:
        bp = getattr(self, "_batch_processor", None)
        queue = getattr(bp, "_queue", None)
        maxlen = getattr(queue, "maxlen", None)
        if queue is None or maxlen is None or getattr(bp, "_shutdown", False):
            return False
        return len(queue) >= maxlen

    def on_end(self, span: ReadableSpan) -> None:
        if not (span.context and span.context.trace_flags.sampled):
            return
        with self._emit_lock:
            if self._queue_full():
                self.stats.add("spans_dropped_queue")
            super().on_end(span)
