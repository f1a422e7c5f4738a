"""OTLP exporters: thin constructors over the SDK's gRPC and HTTP/protobuf exporters.

Everything the SDK already reads from OTEL_EXPORTER_OTLP_* (endpoint when none is given, headers,
certificates, compression, timeout when none is given, metrics temporality preference) is left to
it: explicit argument > OTEL_* env > SDK default.
"""

from __future__ import annotations

import os

# The SDK exporters are imported where used: together with grpc and requests they cost ~200 ms of
# start-up that an agent writing only JSONL need not pay.
PROTOCOLS = ("grpc", "http/protobuf")
_HTTP_PATHS = {"traces": "/v1/traces", "metrics": "/v1/metrics"}


def _check(protocol: str) -> None:
    if protocol not in PROTOCOLS:
        raise ValueError(f"OTLP protocol {protocol!r} is not supported (use one of: {', '.join(PROTOCOLS)})")


def http_signal_url(endpoint: str, signal: str) -> str:
    """Base URL -> signal URL (`http://h:4318` -> `http://h:4318/v1/traces`); a full signal URL is kept."""
    path = _HTTP_PATHS[signal]
    base = endpoint.rstrip("/")
    return base if base.endswith(path) else base + path


def _kwargs(endpoint: str | None, timeout_s: float | None, headers: dict[str, str] | None = None) -> dict:
    kw = {}
    if endpoint is not None:
        kw["endpoint"] = endpoint
    if timeout_s is not None:
        kw["timeout"] = timeout_s
    if headers:
        kw["headers"] = dict(headers)
    return kw


def _http_session():
    """A requests session in which the CA file the exporter sets (OTEL_EXPORTER_OTLP_[TRACES_]CERTIFICATE)
    wins. Plain requests lets REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE in the environment override a session's
    own `verify` (psf/requests#3829), so on a host that sets them for its other tools a private collector
    CA was silently ignored and every export failed certificate verification. Proxies still come from
    the environment. None (the SDK's own session) when an OTEL_PYTHON_* credential provider is set."""
    if any(k.startswith("OTEL_PYTHON_EXPORTER_OTLP_HTTP_") and k.endswith("CREDENTIAL_PROVIDER") for k in os.environ):
        return None
    import requests

    class CaFileSession(requests.Session):
        def merge_environment_settings(self, url, proxies, stream, verify, cert):
            out = super().merge_environment_settings(url, proxies, stream, verify, cert)
            if verify is None and isinstance(self.verify, str):  # a CA file was configured: it wins
                out["verify"] = self.verify
            return out

    return CaFileSession()


def otlp_span_exporter(
    endpoint: str | None, protocol: str = "grpc", timeout_s: float | None = None, insecure: bool | None = None,
    headers: dict[str, str] | None = None,
):
    """SDK OTLP span exporter.

    grpc: `endpoint` like `http://host:4317`; with insecure=None the SDK picks plaintext for an
    `http://` scheme (or OTEL_EXPORTER_OTLP[_TRACES]_INSECURE) and TLS otherwise.
    http/protobuf: `endpoint` is the base URL; `/v1/traces` is appended unless already there.
    endpoint=None / timeout_s=None: the SDK reads OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT / _TIMEOUT
    (its default timeout is 10 s).
    headers: sent with every export, in place of OTEL_EXPORTER_OTLP_[TRACES_]HEADERS for gRPC (the SDK
    takes one or the other) and over them for HTTP; build_exporters passes the merge of both.
    """
    _check(protocol)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(insecure=insecure, **_kwargs(endpoint, timeout_s, headers))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    url = http_signal_url(endpoint, "traces") if endpoint else None
    return OTLPSpanExporter(session=_http_session(), **_kwargs(url, timeout_s, headers))


def otlp_metric_exporter(
    endpoint: str | None, protocol: str = "grpc", timeout_s: float | None = None, insecure: bool | None = None,
    headers: dict[str, str] | None = None,
):
    """SDK OTLP metric exporter; same rules as `otlp_span_exporter` with `/v1/metrics`.

    Temporality is the SDK's: cumulative unless OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE says otherwise.
    """
    _check(protocol)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter(insecure=insecure, **_kwargs(endpoint, timeout_s, headers))
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    url = http_signal_url(endpoint, "metrics") if endpoint else None
    return OTLPMetricExporter(session=_http_session(), **_kwargs(url, timeout_s, headers))
