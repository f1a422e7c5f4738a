"""OTLP-JSON lines file: the agent's embedded default output.

Each line is one OTLP export request in the OTLP/JSON encoding (`{"resourceSpans": [...]}` or
`{"resourceMetrics": [...]}`): the SDK's own protobuf encoder, protobuf's JSON mapping with
lowerCamelCase names and integer enums, and trace/span ids as lowercase hex, which is where OTLP/JSON
departs from the plain proto3 JSON mapping (it would give base64). The collector's
`otlpjsonfile` receiver and `jq` read these files directly.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
from typing import Any, Sequence

from google.protobuf import json_format
from google.protobuf.message import Message
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    MetricExporter,
    MetricExportResult,
    MetricsData,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

_log = logging.getLogger(__name__)

# Every bytes field in the trace and metrics protos that OTLP/JSON encodes as hex (spans, links,
# exemplars). Attribute keys never appear as JSON object keys (they are {"key": ..., "value": ...}),
# so matching on the key name is unambiguous.
ID_FIELDS = frozenset({"traceId", "spanId", "parentSpanId"})


def _ids(obj: Any, convert) -> Any:
    if isinstance(obj, dict):
        return {k: convert(v) if k in ID_FIELDS and isinstance(v, str) else _ids(v, convert) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_ids(v, convert) for v in obj]
    return obj


def ids_to_hex(obj: Any) -> Any:
    """proto3-JSON (base64 ids) -> OTLP/JSON (lowercase hex ids)."""
    return _ids(obj, lambda v: base64.b64decode(v).hex())


def ids_to_base64(obj: Any) -> Any:
    """OTLP/JSON (hex ids) -> proto3-JSON, so that `json_format.ParseDict` accepts the line."""
    return _ids(obj, lambda v: base64.b64encode(bytes.fromhex(v)).decode())


def otlp_json_line(request: Message) -> str:
    """One OTLP export request as a single OTLP/JSON line (no trailing newline)."""
    d = json_format.MessageToDict(request, use_integers_for_enums=True, preserving_proto_field_name=False)
    return json.dumps(ids_to_hex(d), separators=(",", ":"))


def _makedirs(path: str, mode: int) -> None:
    # os.makedirs applies `mode` to the leaf only (Python >= 3.7); every directory we create gets it.
    if not path or os.path.isdir(path):
        return
    _makedirs(os.path.dirname(path), mode)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass


class JsonlWriter:
    """Appends lines to `path`; thread-safe, each line handed to the kernel at once.

    The file is opened O_APPEND, so several writers and logrotate's copytruncate stay consistent. If
    the path no longer names our inode (rotated by rename, or deleted), the next write reopens it.
    Write errors are raised (OSError) for the exporter to turn into a FAILURE; they are counted here.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.lines_written = 0
        self.write_errors = 0
        self.last_error: OSError | None = None
        self._fd: int | None = None
        self._ino: tuple[int, int] | None = None
        self._torn = False  # a write failed part-way (ENOSPC, EFBIG): the file ends in a fragment
        self._lock = threading.Lock()

    def _open(self) -> None:
        _makedirs(os.path.dirname(self.path), 0o750)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self._ino:
            self._torn = False
        self._fd, self._ino = fd, (st.st_dev, st.st_ino)

    def _rotated(self) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != self._ino

    def _close_fd(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError:
                pass

    def write_line(self, line: str) -> None:
        data = (line.rstrip("\n") + "\n").encode()
        with self._lock:
            written = 0
            try:
                if self._fd is not None and self._rotated():
                    self._close_fd()
                if self._fd is None:
                    self._open()
                # End a fragment left by a failed write so that only that one line is unreadable.
                view = memoryview(b"\n" + data if self._torn else data)
                while view:
                    n = os.write(self._fd, view)
                    written, view = written + n, view[n:]
                self._torn = False
            except OSError as e:
                self._torn = self._torn or written > 0
                self.write_errors += 1
                self.last_error = e
                # Reopen on the next write: the file may have been replaced or the disk freed.
                self._close_fd()
                raise
            self.lines_written += 1

    def close(self) -> None:
        """Closes the file; a later write reopens it (span and metric exporters share one writer)."""
        with self._lock:
            self._close_fd()


class _JsonlExporterBase:
    def __init__(self, writer: JsonlWriter) -> None:
        self.writer = writer
        self._failing = False
        self._shutdown = False

    def _write(self, request: Message) -> bool:
        if self._shutdown:
            return False
        try:
            self.writer.write_line(otlp_json_line(request))
        except OSError as e:
            if not self._failing:
                _log.error("jsonl: write %s: %s (counted; logged again after recovery)", self.writer.path, e)
            self._failing = True
            return False
        if self._failing:
            _log.warning("jsonl: writing %s again", self.writer.path)
            self._failing = False
        return True


class JsonlSpanExporter(_JsonlExporterBase, SpanExporter):
    """One `{"resourceSpans": [...]}` line per export call."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        ok = self._write(encode_spans(spans))
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self._shutdown = True
        self.writer.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # every line is written with os.write before export returns


class JsonlMetricExporter(_JsonlExporterBase, MetricExporter):
    """One `{"resourceMetrics": [...]}` line per export call; cumulative temporality unless told otherwise."""

    def __init__(
        self,
        writer: JsonlWriter,
        preferred_temporality: dict[type, AggregationTemporality] | None = None,
        preferred_aggregation: dict | None = None,
    ) -> None:
        _JsonlExporterBase.__init__(self, writer)
        MetricExporter.__init__(self, preferred_temporality, preferred_aggregation)

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        ok = self._write(encode_metrics(metrics_data))
        return MetricExportResult.SUCCESS if ok else MetricExportResult.FAILURE

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        self._shutdown = True
        self.writer.close()
