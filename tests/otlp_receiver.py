"""Loopback OTLP receivers for tests, built on the official opentelemetry-proto definitions.

`GrpcReceiver` serves the collector's TraceService/MetricsService over gRPC; `HttpReceiver` serves
OTLP/HTTP (`POST /v1/traces`, `/v1/metrics`, application/x-protobuf, optionally gzip/deflate). Both
listen on 127.0.0.1 (or `host`: an address inside a network namespace) with a kernel-chosen port, keep
every accepted request, and can be told to fail (`receiver.fail = True`: gRPC UNAVAILABLE / HTTP 503,
both retryable per the OTLP spec) for outage tests.
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric
from opentelemetry.proto.trace.v1.trace_pb2 import Span


def any_value(v: AnyValue):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return attrs(v.kvlist_value.values)
    return getattr(v, kind) if kind else None


def attrs(key_values) -> dict:
    """Repeated KeyValue -> plain dict (int_value -> int, string_value -> str, ...)."""
    return {kv.key: any_value(kv.value) for kv in key_values}


@dataclass
class ReceivedSpan:
    span: Span
    resource: dict
    scope: str

    @property
    def attributes(self) -> dict:
        return attrs(self.span.attributes)


@dataclass
class ReceivedMetric:
    metric: Metric
    resource: dict
    scope: str


class _Receiver:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.fail = False
        self.rejected = 0
        self.trace_requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metrics_requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self.headers: list[dict[str, str]] = []  # per accepted request, lower-case names
        self._cond = threading.Condition()

    def _accept(self, request, headers: dict[str, str]) -> bool:
        with self._cond:
            if self.fail:
                self.rejected += 1
                return False
            is_trace = isinstance(request, trace_service_pb2.ExportTraceServiceRequest)
            (self.trace_requests if is_trace else self.metrics_requests).append(request)
            self.headers.append(headers)
            self._cond.notify_all()
            return True

    def spans(self) -> list[ReceivedSpan]:
        with self._cond:
            return [
                ReceivedSpan(span, attrs(rs.resource.attributes), ss.scope.name)
                for req in self.trace_requests
                for rs in req.resource_spans
                for ss in rs.scope_spans
                for span in ss.spans
            ]

    def metrics(self) -> list[ReceivedMetric]:
        with self._cond:
            return [
                ReceivedMetric(m, attrs(rm.resource.attributes), sm.scope.name)
                for req in self.metrics_requests
                for rm in req.resource_metrics
                for sm in rm.scope_metrics
                for m in sm.metrics
            ]

    def wait_for(self, predicate, timeout: float = 5.0) -> bool:
        """Waits until `predicate()` is true (re-checked on every accepted request)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def wait_for_spans(self, n: int, timeout: float = 5.0) -> list[ReceivedSpan]:
        if not self.wait_for(lambda: len(self.spans()) >= n, timeout):
            raise TimeoutError(f"{type(self).__name__}: {len(self.spans())} of {n} spans after {timeout}s")
        return self.spans()

    def wait_for_metric(self, name: str, timeout: float = 5.0) -> list[ReceivedMetric]:
        found = lambda: [m for m in self.metrics() if m.metric.name == name]  # noqa: E731
        if not self.wait_for(lambda: bool(found()), timeout):
            raise TimeoutError(f"{type(self).__name__}: no metric {name!r} after {timeout}s")
        return found()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class GrpcReceiver(_Receiver):
    """credentials: grpc.ssl_server_credentials(...) for a TLS (or, requiring client certs, mTLS) receiver."""

    def __init__(self, credentials: grpc.ServerCredentials | None = None, host: str = "127.0.0.1") -> None:
        super().__init__(host)
        self._server: grpc.Server | None = None
        self._credentials = credentials
        self.port: int | None = None

    @property
    def endpoint(self) -> str:
        return f"{'https' if self._credentials else 'http'}://{self.host}:{self.port}"

    def _handle(self, request, context, response):
        if not self._accept(request, dict(context.invocation_metadata())):
            context.abort(grpc.StatusCode.UNAVAILABLE, "receiver told to fail")
        return response

    def start(self) -> None:
        receiver = self

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                return receiver._handle(request, context, trace_service_pb2.ExportTraceServiceResponse())

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):
                return receiver._handle(request, context, metrics_service_pb2.ExportMetricsServiceResponse())

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), self._server)
        if self._credentials is not None:
            self.port = self._server.add_secure_port(f"{self.host}:{self.port or 0}", self._credentials)
        else:  # a restart after stop() listens on the same port again (collector outage tests)
            self.port = self._server.add_insecure_port(f"{self.host}:{self.port or 0}")
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None


class HttpReceiver(_Receiver):
    ROUTES = {
        "/v1/traces": (trace_service_pb2.ExportTraceServiceRequest, trace_service_pb2.ExportTraceServiceResponse),
        "/v1/metrics": (
            metrics_service_pb2.ExportMetricsServiceRequest,
            metrics_service_pb2.ExportMetricsServiceResponse,
        ),
    }

    def __init__(self, ssl_context=None, host: str = "127.0.0.1") -> None:
        """ssl_context: a server-side ssl.SSLContext for HTTPS (verify_mode CERT_REQUIRED: mTLS)."""
        super().__init__(host)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._ssl = ssl_context

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def endpoint(self) -> str:
        return f"{'https' if self._ssl else 'http'}://{self.host}:{self.port}"

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _reply(self, code: int, body: bytes = b"", ctype: str = "text/plain") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                route = receiver.ROUTES.get(self.path)
                if route is None:
                    return self._reply(404, b"unknown path")
                if self.headers.get("Content-Type") != "application/x-protobuf":
                    return self._reply(415, b"want application/x-protobuf")
                encoding = self.headers.get("Content-Encoding", "identity")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                elif encoding != "identity":
                    return self._reply(415, b"unknown Content-Encoding")
                request_type, response_type = route
                headers = {k.lower(): v for k, v in self.headers.items()}
                if not receiver._accept(request_type.FromString(body), headers):
                    return self._reply(503, b"receiver told to fail")
                self._reply(200, response_type().SerializeToString(), "application/x-protobuf")

        self._server = ThreadingHTTPServer((self.host, 0), Handler)
        if self._ssl is not None:  # the handshake runs in the worker thread, on the first read
            self._server.socket = self._ssl.wrap_socket(self._server.socket, server_side=True,
                                                        do_handshake_on_connect=False)
        # A short poll interval keeps stop() (which waits for the serve loop to notice) fast.
        serve = lambda: self._server.serve_forever(poll_interval=0.05)  # noqa: E731
        self._thread = threading.Thread(target=serve, name="otlp-http-receiver", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(5)
            self._server = None
