"""OTLP-JSON lines file: the agent's embedded default output.

Each line is one OTLP export request in the OTLP/JSON encoding (`{"resourceSpans": [...]}` or
`{"resourceMetrics": [...]}`): the SDK's own protobuf encoder, protobuf's JSON mapping with
lowerCamelCase names and integer enums, and trace/span ids as lowercase hex, which is where OTLP/JSON
departs from the plain proto3 JSON mapping (it would give base64). The collector's
`otlpjsonfile` receiver and `jq` read these files directly.

Spans take a direct path (`spans_json_line`): the same JSON built straight from the SDK's spans,
without the protobuf message and its JSON mapping in between, which cost 3-4x more per span (see
docs/PERFORMANCE.md). It mirrors `otlp_json_line(encode_spans(spans))` rule for rule, byte for
byte: fields in field-number order, fields at their proto3 default left out, 64-bit integers as
strings, doubles as Python floats (NaN and infinities as strings), attributes the SDK encoder
refuses (an int beyond 64 bits, a string that is not valid UTF-8, an unknown type) left out and
logged as it does. Checked against opentelemetry-exporter-otlp-proto-common 1.45 and protobuf 7.36
(upb); a change in either's encoder or JSON mapping needs the comparison run again. Metrics keep the protobuf path (`metrics_json_line`), with ids converted only in
exemplars, the one place they occur there.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import threading
from collections.abc import Mapping
from collections.abc import Sequence as AbcSequence
from typing import Any, Sequence

from google.protobuf import json_format
from google.protobuf.message import Message
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    MetricExporter,
    MetricExportResult,
    MetricsData,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind

from .files import UnsafeFileError, _makedirs, _open_append

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


_POINT_KINDS = ("gauge", "sum", "histogram", "exponentialHistogram", "summary")


def metrics_json_line(request: Message) -> str:
    """`otlp_json_line` of an ExportMetricsServiceRequest, converting only where ids can be: the trace
    and metrics protos' only bytes fields on the metrics side are an exemplar's traceId and spanId,
    so the rest of the (large: every series of every process) dict is not walked again."""
    d = json_format.MessageToDict(request, use_integers_for_enums=True, preserving_proto_field_name=False)
    for rm in d.get("resourceMetrics", ()):
        for sm in rm.get("scopeMetrics", ()):
            for metric in sm.get("metrics", ()):
                for kind in _POINT_KINDS:
                    for point in metric.get(kind, {}).get("dataPoints", ()):
                        for ex in point.get("exemplars", ()):
                            for key in ("traceId", "spanId"):
                                if isinstance(ex.get(key), str):
                                    ex[key] = base64.b64decode(ex[key]).hex()
    return json.dumps(d, separators=(",", ":"))


# ---- spans, directly: the JSON that otlp_json_line(encode_spans(spans)) gives ----

_KIND = {SpanKind.INTERNAL: 1, SpanKind.SERVER: 2, SpanKind.CLIENT: 3, SpanKind.PRODUCER: 4, SpanKind.CONSUMER: 5}
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200  # SpanFlags masks, as the SDK encoder sets them


def _utf8(s: str) -> str:
    # protobuf refuses strings it cannot encode as UTF-8 (lone surrogates): UnicodeEncodeError, as there
    if not s.isascii():
        s.encode("utf-8")
    return s


def _value(v: Any) -> dict:
    """AnyValue as MessageToDict renders it; the type tests in the SDK encoder's order."""
    if v is None:
        return {}
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, str):
        return {"stringValue": _utf8(v)}
    if isinstance(v, int):
        if not _INT64_MIN <= v <= _INT64_MAX:
            raise ValueError(f"Value out of range: {v}")
        return {"intValue": str(int(v))}
    if isinstance(v, float):
        v = float(v)
        if math.isinf(v):
            return {"doubleValue": "-Infinity" if v < 0 else "Infinity"}
        return {"doubleValue": "NaN" if math.isnan(v) else v}
    if isinstance(v, bytes):
        return {"bytesValue": base64.b64encode(v).decode()}
    if isinstance(v, AbcSequence):
        values = [_value(x) for x in v]
        return {"arrayValue": {"values": values} if values else {}}
    if isinstance(v, Mapping):
        values = [_key_value(str(k), x) for k, x in v.items()]
        return {"kvlistValue": {"values": values} if values else {}}
    raise Exception(f"Invalid type {type(v)} of value {v}")  # noqa: TRY002 - the SDK encoder's own


def _key_value(key: str, v: Any) -> dict:
    val = _value(v)
    return {"key": _utf8(key), "value": val} if key else {"value": val}


def _attributes(attributes) -> list[dict]:
    out: list[dict] = []
    if attributes:
        append = out.append
        for key, v in attributes.items():
            # fast paths for the common exact types (ASCII str, int in range, bool); the rest in full
            if type(key) is str and key and key.isascii():
                t = type(v)
                if t is str and v.isascii():
                    append({"key": key, "value": {"stringValue": v}})
                    continue
                if t is int and _INT64_MIN <= v <= _INT64_MAX:
                    append({"key": key, "value": {"intValue": str(v)}})
                    continue
                if t is bool:
                    append({"key": key, "value": {"boolValue": v}})
                    continue
            try:
                append(_key_value(key, v))
            except Exception as e:  # noqa: BLE001 - skipped and logged, as the SDK encoder does
                _log.exception("Failed to encode key %s: %s", key, e)
    return out


def _uint(v: int, bits: int) -> int:
    if not 0 <= v < 1 << bits:
        raise ValueError(f"Value out of range: {v}")
    return v


def _span(s: ReadableSpan) -> dict:
    ctx = s.get_span_context()
    d: dict[str, Any] = {"traceId": f"{_uint(ctx.trace_id, 128):032x}", "spanId": f"{_uint(ctx.span_id, 64):016x}"}
    if ctx.trace_state is not None:
        ts = ",".join([f"{k}={v}" for k, v in ctx.trace_state.items()])
        if ts:
            d["traceState"] = _utf8(ts)
    parent = s.parent
    if parent:
        d["parentSpanId"] = f"{_uint(parent.span_id, 64):016x}"
    if s.name:
        d["name"] = _utf8(s.name)
    d["kind"] = _KIND[s.kind]
    if s.start_time:
        d["startTimeUnixNano"] = str(_uint(s.start_time, 64))
    if s.end_time:
        d["endTimeUnixNano"] = str(_uint(s.end_time, 64))
    attrs = _attributes(s.attributes)
    if attrs:
        d["attributes"] = attrs
    if s.dropped_attributes:
        d["droppedAttributesCount"] = _uint(s.dropped_attributes, 32)
    if s.events:
        events = []
        for ev in s.events:
            e: dict[str, Any] = {}
            if ev.timestamp:
                e["timeUnixNano"] = str(_uint(ev.timestamp, 64))
            if ev.name:
                e["name"] = _utf8(ev.name)
            ev_attrs = _attributes(ev.attributes)
            if ev_attrs:
                e["attributes"] = ev_attrs
            if ev.dropped_attributes:
                e["droppedAttributesCount"] = _uint(ev.dropped_attributes, 32)
            events.append(e)
        d["events"] = events
    if s.dropped_events:
        d["droppedEventsCount"] = _uint(s.dropped_events, 32)
    if s.links:
        links = []
        for link in s.links:
            lc = link.context
            lk: dict[str, Any] = {"traceId": f"{_uint(lc.trace_id, 128):032x}",
                                  "spanId": f"{_uint(lc.span_id, 64):016x}"}
            link_attrs = _attributes(link.attributes)
            if link_attrs:
                lk["attributes"] = link_attrs
            if link.dropped_attributes:
                lk["droppedAttributesCount"] = _uint(link.dropped_attributes, 32)
            lk["flags"] = _HAS_IS_REMOTE | (_IS_REMOTE if lc.is_remote else 0)
            links.append(lk)
        d["links"] = links
    if s.dropped_links:
        d["droppedLinksCount"] = _uint(s.dropped_links, 32)
    st = s.status
    if st is not None:
        status: dict[str, Any] = {}
        if st.description:
            status["message"] = _utf8(st.description)
        if st.status_code.value:
            status["code"] = st.status_code.value
        d["status"] = status
    d["flags"] = _HAS_IS_REMOTE | (_IS_REMOTE if parent and parent.is_remote else 0)
    return d


def spans_json_line(spans: Sequence[ReadableSpan]) -> str:
    """The OTLP/JSON line of `otlp_json_line(encode_spans(spans))`, built without protobuf.

    Spans are grouped by resource, then by instrumentation scope, in order of first appearance, as
    the SDK encoder groups them (dicts keyed by the objects themselves; consecutive spans sharing the
    same objects skip the lookup, whose hash of a Resource serializes its attributes)."""
    groups: dict = {}
    last_res = last_scope = cur = None
    for s in spans:
        res, scope = s.resource, s.instrumentation_scope or None
        if cur is None or res is not last_res or scope is not last_scope:
            cur = groups.setdefault(res, {}).setdefault(scope, [])
            last_res, last_scope = res, scope
        cur.append(_span(s))
    resource_spans = []
    for res, scopes in groups.items():
        scope_spans = []
        for scope, span_dicts in scopes.items():
            sc: dict[str, Any] = {}
            if scope is not None:
                if scope.name:
                    sc["name"] = _utf8(scope.name)
                if scope.version:
                    sc["version"] = _utf8(scope.version)
                scope_attrs = _attributes(scope.attributes)
                if scope_attrs:
                    sc["attributes"] = scope_attrs
            ss: dict[str, Any] = {"scope": sc, "spans": span_dicts}
            if scope is not None and scope.schema_url:
                ss["schemaUrl"] = _utf8(scope.schema_url)
            scope_spans.append(ss)
        res_attrs = _attributes(res.attributes)
        rs: dict[str, Any] = {"resource": {"attributes": res_attrs} if res_attrs else {}, "scopeSpans": scope_spans}
        if res.schema_url:
            rs["schemaUrl"] = _utf8(res.schema_url)
        resource_spans.append(rs)
    return json.dumps({"resourceSpans": resource_spans} if resource_spans else {}, separators=(",", ":"))


class JsonlWriter:
    """Appends lines to `path`; thread-safe, each line handed to the kernel at once.

    The file is opened O_APPEND, so several writers and logrotate's copytruncate stay consistent. If
    the path no longer names our inode (rotated by rename, or deleted), the next write reopens it.
    Write errors are raised (OSError) for the exporter to turn into a FAILURE; they are counted here.
    A path that is not safe to append to (_open_append: a symlink, someone else's file, a directory
    others can write) is refused at each open, counted in `refused` as well, and tried again on the
    next write.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.lines_written = 0
        self.write_errors = 0
        self.refused = 0  # opens refused as unsafe (UnsafeFileError), also in write_errors
        self.last_error: OSError | None = None
        self._fd: int | None = None
        self._ino: tuple[int, int] | None = None
        self._torn = False  # a write failed part-way (ENOSPC, EFBIG): the file ends in a fragment
        self._lock = threading.Lock()

    def _open(self) -> None:
        _makedirs(os.path.dirname(self.path), 0o750)
        try:
            fd, st = _open_append(self.path)
        except UnsafeFileError:
            self.refused += 1
            raise
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

    def _write(self, line: str) -> bool:
        if self._shutdown:
            return False
        try:
            self.writer.write_line(line)
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
        if self._shutdown:
            return SpanExportResult.FAILURE
        ok = self._write(spans_json_line(spans))
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
        if self._shutdown:
            return MetricExportResult.FAILURE
        ok = self._write(metrics_json_line(encode_metrics(metrics_data)))
        return MetricExportResult.SUCCESS if ok else MetricExportResult.FAILURE

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        self._shutdown = True
        self.writer.close()
