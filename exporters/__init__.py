"""Where the agent's spans and metrics go: JSONL file, OTLP (gRPC or HTTP/protobuf), console, and a
Prometheus scrape endpoint (off by default).

Data flow: the capabilities turn BPF records into span specs and metric rows, agent/telemetry/otel.py
turns those into SDK spans and observations; the SDK's batch span processor and periodic metric
reader hand finished telemetry to the exporters built here, the one place they are assembled. Exporters
only read what they are given: they never call back into the agent or the probes, and a failing
sink returns FAILURE (counted in `ExportStats`) instead of raising into the SDK worker.

    spans   -> CountingBatchSpanProcessor -> CountingSpanExporter -> MultiSpanExporter -> jsonl | otlp | console
    metrics -> PeriodicExportingMetricReader (one per sink) -> CountingMetricExporter -> jsonl | otlp | console
    metrics -> PrometheusReader (pulled: each GET /metrics collects) <- PrometheusServer (docs/PROMETHEUS.md)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Callable

from ..redact import redact_url

if TYPE_CHECKING:
    from .counting import CountingMetricExporter, CountingSpanExporter, ExportStats

# The sinks' modules import the OpenTelemetry SDK and protobuf (~0.3 s of a GPU host's start): they
# are imported where they are used, after the probes are attached; `mcp-agent run` imports them in a
# thread while the BPF unit compiles (modules_for, cli.py). The names stay importable from here.
_LAZY = {
    "ConsoleMetricExporter": "console", "ConsoleSpanExporter": "console",
    "CountingBatchSpanProcessor": "counting", "CountingMetricExporter": "counting",
    "CountingSpanExporter": "counting", "ExportStats": "counting", "MultiSpanExporter": "counting",
    "JsonlMetricExporter": "jsonl", "JsonlSpanExporter": "jsonl", "JsonlWriter": "jsonl",
    "otlp_metric_exporter": "otlp", "otlp_span_exporter": "otlp",
    "PrometheusReader": "prometheus", "PrometheusServer": "prometheus", "ListenError": "prometheus",
    "install_export_error_filters": "counting", "metrics_path": "files",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def modules_for(cfg) -> list[str]:
    """The modules from_config(cfg) imports (with them the SDK, protobuf, and grpc or requests for
    OTLP): what `mcp-agent run` imports in a thread while the BPF unit compiles (cli.py)."""
    mods = [f"{__name__}.{m}" for m in ("counting", "files", "console", "jsonl", "otlp", "prometheus")]  # always
    if cfg.export_otlp_endpoint or _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
                                        "OTEL_EXPORTER_OTLP_ENDPOINT"):
        protocol = cfg.export_otlp_protocol or _env("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
        kind = "grpc" if protocol == "grpc" else "http"
        mods += [f"opentelemetry.exporter.otlp.proto.{kind}.{s}_exporter" for s in ("trace", "metric")]
    return mods


__all__ = [
    "ConsoleMetricExporter",
    "ConsoleSpanExporter",
    "CountingBatchSpanProcessor",
    "CountingMetricExporter",
    "CountingSpanExporter",
    "ExportStats",
    "Exporters",
    "JsonlMetricExporter",
    "JsonlSpanExporter",
    "JsonlWriter",
    "MultiSpanExporter",
    "PrometheusReader",
    "PrometheusServer",
    "build_exporters",
    "otlp_metric_exporter",
    "otlp_span_exporter",
]


@dataclass
class Exporters:
    span_exporter: CountingSpanExporter
    metric_exporters: list[CountingMetricExporter]
    stats: ExportStats
    sinks: list[str] = field(default_factory=list)
    # Metric readers the MeterProvider must be given as they are (pulled, not periodic): the
    # PrometheusReader when export.prometheus_listen is set.
    pull_readers: list = field(default_factory=list)
    # What close() stops: the Prometheus HTTP server (it holds its port until then).
    servers: list = field(default_factory=list)

    def describe(self) -> list[str]:
        """One human line per sink, e.g. `jsonl: /var/lib/mcp-agent/telemetry.jsonl`."""
        return list(self.sinks) or ["none: telemetry is collected but not exported"]

    def close(self) -> None:
        """Stop what serves telemetry (the Prometheus endpoint) and free its port. Idempotent; the
        SDK's readers and exporters are shut down by their providers, not here."""
        for server in self.servers:
            server.close()


def _env(*names: str) -> str | None:
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


def _headers(signal: str, extra: dict[str, str] | None) -> dict[str, str] | None:
    """The signal's OTEL_* headers with `extra` over them; None (the SDK reads the env) without extra."""
    if not extra:
        return None
    from opentelemetry.util.re import parse_env_headers

    raw = _env(f"OTEL_EXPORTER_OTLP_{signal}_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS") or ""
    return {**parse_env_headers(raw, liberal=True), **{k.lower(): v for k, v in extra.items()}}


def build_exporters(
    jsonl_path: str | None,
    otlp_endpoint: str | None,
    otlp_protocol: str | None = None,
    console_stream: IO[str] | None = None,
    stats: ExportStats | None = None,
    *,
    otlp_timeout_s: float | None = None,
    otlp_headers: dict[str, str] | None = None,
    prometheus_listen: str | None = None,
    prometheus_extra: Callable[[], list] | None = None,
) -> Exporters:
    """Build the counting, fanned-out span exporter and one counting metric exporter per sink.

    OTLP is on when `otlp_endpoint` is given or OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]ENDPOINT is set
    (then the SDK reads it). Protocol: `otlp_protocol` > OTEL_EXPORTER_OTLP_PROTOCOL > "grpc".
    `otlp_headers` (export.headers_file: tokens) go to the exporter constructors, over the headers of
    OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]HEADERS; they are never put in the environment.
    `prometheus_listen` (host:port): a PrometheusReader in `pull_readers`, served on GET /metrics
    from now until close(); ValueError (one line) when the address is malformed or cannot be bound.
    `prometheus_extra` returns further Metric objects for each scrape (PrometheusReader's extra).
    """
    from .counting import ExportStats
    from .prometheus import PrometheusReader, PrometheusServer

    stats = ExportStats() if stats is None else stats
    spans, metrics, sinks = [], [], []
    pull_readers, servers = [], []
    if prometheus_listen:  # first: a busy port fails before any file or connection is opened
        reader = PrometheusReader(extra=prometheus_extra)
        servers.append(PrometheusServer(prometheus_listen, reader.scrape))
        pull_readers.append(reader)
    try:
        return _build(jsonl_path, otlp_endpoint, otlp_protocol, console_stream, stats, otlp_timeout_s, otlp_headers,
                      spans, metrics, sinks, pull_readers, servers)
    except BaseException:
        for server in servers:
            server.close()
        raise


def _build(jsonl_path, otlp_endpoint, otlp_protocol, console_stream, stats, otlp_timeout_s, otlp_headers,
           spans, metrics, sinks, pull_readers, servers) -> Exporters:
    from .console import ConsoleMetricExporter, ConsoleSpanExporter
    from .counting import CountingMetricExporter, CountingSpanExporter, MultiSpanExporter, install_export_error_filters
    from .files import metrics_path
    from .jsonl import JsonlMetricExporter, JsonlSpanExporter, JsonlWriter
    from .otlp import otlp_metric_exporter, otlp_span_exporter

    if jsonl_path:
        writer, mwriter = JsonlWriter(jsonl_path), JsonlWriter(metrics_path(jsonl_path))
        spans.append(JsonlSpanExporter(writer))
        metrics.append(JsonlMetricExporter(mwriter))
        sinks.append(f"jsonl: {writer.path} (spans), {mwriter.path} (metrics)")

    protocol = otlp_protocol or _env("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    th, mh = _headers("TRACES", otlp_headers), _headers("METRICS", otlp_headers)
    if otlp_endpoint:
        spans.append(otlp_span_exporter(otlp_endpoint, protocol, otlp_timeout_s, headers=th))
        metrics.append(otlp_metric_exporter(otlp_endpoint, protocol, otlp_timeout_s, headers=mh))
        sinks.append(f"otlp {protocol}: {redact_url(otlp_endpoint)}")
    else:  # endpoint=None: the SDK reads it from env; a signal without one stays off
        if env := _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
            spans.append(otlp_span_exporter(None, protocol, otlp_timeout_s, headers=th))
            sinks.append(f"otlp {protocol} traces: {redact_url(env)} (from env)")
        if env := _env("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
            metrics.append(otlp_metric_exporter(None, protocol, otlp_timeout_s, headers=mh))
            sinks.append(f"otlp {protocol} metrics: {redact_url(env)} (from env)")
    otlp_on = any(s.startswith("otlp ") for s in sinks)
    if otlp_on:  # its retries and failures are logged at most every 30 s (and counted, always)
        install_export_error_filters()
    if otlp_headers and otlp_on:
        sinks.append(f"otlp headers: {', '.join(sorted(k.lower() for k in otlp_headers))} "
                     "(from export.headers_file; values not shown)")

    if console_stream is not None:
        spans.append(ConsoleSpanExporter(console_stream))
        metrics.append(ConsoleMetricExporter(console_stream))  # a summary line per metric name and interval
        sinks.append(f"console: {getattr(console_stream, 'name', type(console_stream).__name__)} "
                     "(spans, metric summaries)")
    for server in servers:
        sinks.append(f"prometheus: {server.url}" + ("" if _loopback(server.host) else
                                                     " (not loopback: anyone who can reach it reads every metric)"))

    return Exporters(
        span_exporter=CountingSpanExporter(MultiSpanExporter(spans), stats),
        metric_exporters=[CountingMetricExporter(m, stats) for m in metrics],
        stats=stats,
        sinks=sinks,
        pull_readers=pull_readers,
        servers=servers,
    )


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def from_config(cfg) -> Exporters:
    """The exporters `mcp-agent run` uses: the JSONL file, OTLP, the console and the Prometheus
    endpoint as the settings say; export.headers_file's headers go to the OTLP exporter constructors,
    never to the environment or argv. ConfigError (one line) when the headers file is unreadable or
    unsafe, or export.prometheus_listen cannot be bound (in use, not this host's address)."""
    import json
    import sys

    from ..config import ConfigError
    from ..otlpheaders import read_headers_file
    from .prometheus import ListenError

    headers = None
    if cfg.export_headers_file:
        try:
            headers = read_headers_file(cfg.export_headers_file)
        except ValueError as e:  # changed since load_config checked it
            raise ConfigError(f"export.headers_file = {cfg.export_headers_file!r}: {e}") from None
    listen = cfg.export_prometheus_listen or None
    try:
        return build_exporters(cfg.export_jsonl_path or None, cfg.export_otlp_endpoint, cfg.export_otlp_protocol,
                               console_stream=sys.stdout if cfg.export_console else None, otlp_headers=headers,
                               prometheus_listen=listen)
    except ListenError as e:  # in use, or not this host's address: the agent does not start
        source = cfg.sources.get("export.prometheus_listen", "default")
        raise ConfigError(f"export.prometheus_listen = {json.dumps(listen)} (from {source}): {e.reason}") from None


def counting_only(note: str = "none: telemetry is counted, not exported") -> Exporters:
    """Exporters that count spans and export nothing (`mcp-agent top` running its own probes)."""
    from .counting import CountingSpanExporter, ExportStats, MultiSpanExporter

    stats = ExportStats()
    return Exporters(CountingSpanExporter(MultiSpanExporter([]), stats), [], stats, [note])
