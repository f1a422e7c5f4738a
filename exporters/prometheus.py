"""Prometheus scrape endpoint (off by default): the SDK's metrics in the text exposition format 0.0.4.

    MeterProvider -> PrometheusReader (pull, cumulative) -> render() -> PrometheusServer: GET /metrics

Names follow the OpenTelemetry -> Prometheus compatibility specification
(opentelemetry.io/docs/specs/otel/compatibility/prometheus_and_openmetrics/), as the collector's
translator does it:

- metric and label names: every character outside [a-zA-Z0-9_:] (labels: [a-zA-Z0-9_]) becomes `_`,
  runs of `_` collapse into one; a metric name starting with a digit gets a leading `_`, a label
  name `key_` (a label starting with `_` gets `key`: Prometheus reserves `__`);
- the unit, unless the name already holds it, is appended as a word (`s` -> `_seconds`, `By` ->
  `_bytes`, `{packet}` dropped, `{packet}/s` -> `_per_second`, `1` -> `_ratio` for gauges only);
- monotonic cumulative Sum -> counter `<name>_total`; non-monotonic Sum and Gauge -> gauge;
  Histogram -> classic histogram; ExponentialHistogram -> classic histogram whose `le` bounds are
  the exponential buckets' upper bounds (zero and negative counts in the first one);
- `otel_scope_name` / `otel_scope_version` labels name the instrumentation scope, and one
  `target_info` gauge (value 1) carries the resource attributes. `job` and `instance` are not
  emitted: Prometheus adds them from the scrape config.

What cannot be rendered (delta temporality, which our cumulative readers never produce; a name whose
type clashes with an earlier family of that name; a series already emitted) is skipped and counted by
reason in the `skipped` mapping handed to render() (PrometheusReader.skipped).

PrometheusServer binds `host:port` (`[::1]:9464` for IPv6, `:9464` for every interface) and serves
GET /metrics from a daemon thread; anything else is 404, a failing scrape 500 (counted). There is no
authentication: bind to a non-loopback address only on a network that may read every metric.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import re
import socket
import socketserver
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable, Mapping, MutableMapping, Sequence

from opentelemetry.sdk.metrics import (
    Counter as SdkCounter,
    Histogram as SdkHistogram,
    ObservableCounter,
    ObservableGauge,
    ObservableUpDownCounter,
    UpDownCounter,
)
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    ExponentialHistogram,
    Gauge,
    Histogram,
    Metric,
    MetricReader,
    MetricsData,
    Sum,
)

try:  # the synchronous gauge (SDK >= 1.23)
    from opentelemetry.sdk.metrics import _Gauge as SdkGauge
except ImportError:  # pragma: no cover
    SdkGauge = None

__all__ = ["CONTENT_TYPE", "ListenError", "PrometheusReader", "PrometheusServer", "metric_name", "label_name",
           "parse_listen", "render"]

_log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# ---- names -----------------------------------------------------------------------------------------

_BAD_METRIC = re.compile(r"[^a-zA-Z0-9_:]")
_BAD_LABEL = re.compile(r"[^a-zA-Z0-9_]")
_RUNS = re.compile(r"__+")

# The collector's unit words (pkg/translator/prometheus), plus the prefixed SI units the agent uses.
_UNITS = {
    "d": "days", "h": "hours", "min": "minutes", "s": "seconds", "ms": "milliseconds", "us": "microseconds",
    "ns": "nanoseconds",
    "By": "bytes", "KiBy": "kibibytes", "MiBy": "mebibytes", "GiBy": "gibibytes", "TiBy": "tibibytes",
    "KBy": "kilobytes", "MBy": "megabytes", "GBy": "gigabytes", "TBy": "terabytes",
    "m": "meters", "V": "volts", "A": "amperes", "J": "joules", "W": "watts", "g": "grams",
    "mW": "milliwatts", "kW": "kilowatts", "kHz": "kilohertz", "MHz": "megahertz", "GHz": "gigahertz",
    "Cel": "celsius", "Hz": "hertz", "%": "percent",
}
_PER_UNITS = {"s": "second", "m": "minute", "h": "hour", "d": "day", "w": "week", "mo": "month", "y": "year"}
_ANNOTATION = re.compile(r"\{[^}]*\}")


def _sanitize(text: str, bad: re.Pattern) -> str:
    return _RUNS.sub("_", bad.sub("_", text))


def label_name(key: str) -> str:
    """An attribute key as a Prometheus label name."""
    name = _sanitize(str(key), _BAD_LABEL)
    if not name:
        return "key_"
    if name[0].isdigit():
        return "key_" + name
    if name[0] == "_":
        return "key" + name
    return name


def _unit_words(unit: str | None, is_gauge: bool) -> str:
    """The unit as name words (`ms` -> `milliseconds`, `{packet}/s` -> `per_second`); "" for none."""
    unit = (unit or "").strip()
    if unit == "1":
        return "ratio" if is_gauge else ""
    main, _, per = unit.partition("/")
    main, per = _ANNOTATION.sub("", main).strip(), _ANNOTATION.sub("", per).strip()
    words = []
    if main:
        words.append(_UNITS.get(main, main))
    if per:
        words.append("per_" + _PER_UNITS.get(per, per))
    return _sanitize("_".join(words), _BAD_METRIC).strip("_")


def metric_name(name: str, unit: str | None = None, kind: str = "gauge", is_gauge: bool | None = None) -> str:
    """The Prometheus family name of an OTel metric. kind: "counter" (gets `_total`), "gauge",
    "histogram". is_gauge: whether the OTel data is a Gauge (`1` -> `_ratio`), default kind == "gauge"."""
    base = _sanitize(str(name), _BAD_METRIC).strip("_") or "_"
    if kind == "counter" and base.endswith("_total"):
        base = base[: -len("_total")] or "_"
    words = _unit_words(unit, kind == "gauge" if is_gauge is None else is_gauge)
    if words and f"_{words}_" not in f"_{base}_":
        base = f"{base}_{words}"
    if kind == "counter":
        base += "_total"
    if base[0].isdigit():
        base = "_" + base
    return base


# ---- values ----------------------------------------------------------------------------------------

def _num(v: Any) -> str:
    """A sample value or `le` bound: NaN, +Inf, -Inf; integral values without a fraction."""
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(v)


def _label_text(v: Any) -> str:
    """An attribute value as label text: str() (bool as true/false, sequences as JSON, as the spec says)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return v
    if isinstance(v, (list, tuple)):
        return json.dumps([x if isinstance(x, (bool, int, float, str)) or x is None else str(x) for x in v],
                          ensure_ascii=False)
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return str(v)


def _escape_value(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(attrs: Mapping[str, Any] | None) -> dict[str, str]:
    """Attributes -> {label name: text}; keys that sanitise to one name have their values joined by
    `;` in the order of the original keys (as the spec says)."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for k, v in (attrs or {}).items():
        if v is None:
            continue
        groups.setdefault(label_name(k), []).append((str(k), _label_text(v)))
    return {n: ";".join(t for _, t in sorted(kv)) for n, kv in groups.items()}


def _label_str(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape_value(v)}"' for k, v in labels.items()) + "}"


# ---- families --------------------------------------------------------------------------------------

@dataclass
class _Family:
    name: str
    type: str  # counter | gauge | histogram
    help: str
    lines: list[str] = field(default_factory=list)
    series: set = field(default_factory=set)

    def reserve(self, sample: str, labels: Mapping[str, str]) -> bool:
        """False if this series was already emitted (then it must not be again)."""
        key = (sample, tuple(sorted(labels.items())))
        if key in self.series:
            return False
        self.series.add(key)
        return True

    def line(self, sample: str, labels: Mapping[str, str], value: Any) -> None:
        self.lines.append(f"{sample}{_label_str(labels)} {_num(value)}")

    def add(self, sample: str, labels: Mapping[str, str], value: Any) -> bool:
        if not self.reserve(sample, labels):
            return False
        self.line(sample, labels, value)
        return True


def _count(skipped: MutableMapping[str, int] | None, reason: str, n: int = 1) -> None:
    if skipped is not None and n:
        skipped[reason] = skipped.get(reason, 0) + n


def _exp_buckets(dp) -> list[tuple[float, int]]:
    """(upper bound, cumulative count) of an exponential histogram point, +Inf excluded: bucket i of
    the positive range holds (base**(offset+i), base**(offset+i+1)], base = 2**(2**-scale); zero and
    negative observations are below every positive bound, so they count from the first bucket on.
    Leading empty buckets are left out (the CDF at them equals the first emitted one's start)."""
    scale = dp.scale
    below = dp.zero_count + sum(dp.negative.bucket_counts)
    counts = list(dp.positive.bucket_counts)
    first = next((i for i, c in enumerate(counts) if c), len(counts))
    out, cum = [], below
    for i in range(first, len(counts)):
        cum += counts[i]
        idx = dp.positive.offset + i + 1
        try:
            bound = math.ldexp(1.0, idx << -scale) if scale <= 0 else 2.0 ** (idx / (1 << scale))
        except OverflowError:
            bound = math.inf
        if math.isinf(bound):
            break
        out.append((bound, cum))
    return out


def render(metrics_data: MetricsData | None, extra: Iterable[Metric] = (),
           skipped: MutableMapping[str, int] | None = None) -> str:
    """The text exposition (format 0.0.4) of `metrics_data` and of `extra` (metrics not from a
    MeterProvider: no scope labels). `skipped`, when given, counts what was left out, by reason."""
    families: dict[str, _Family] = {}
    targets: list[dict[str, str]] = []

    def family(name: str, kind: str, help_text: str) -> _Family | None:
        fam = families.get(name)
        if fam is None:
            fam = families[name] = _Family(name, kind, help_text)
        elif fam.type != kind:
            _count(skipped, "type conflict")
            return None
        return fam

    def add_metric(m: Metric, scope_labels: Mapping[str, str]) -> None:
        data = m.data
        help_text = m.description or m.name
        if isinstance(data, (Sum, Histogram, ExponentialHistogram)) and \
                data.aggregation_temporality != AggregationTemporality.CUMULATIVE:
            _count(skipped, "delta temporality")
            return
        if isinstance(data, Sum) or isinstance(data, Gauge):
            kind = "counter" if isinstance(data, Sum) and data.is_monotonic else "gauge"
            fam = family(metric_name(m.name, m.unit, kind, is_gauge=isinstance(data, Gauge)), kind, help_text)
            if fam is None:
                return
            for dp in data.data_points:
                labels = {**_labels(dp.attributes), **scope_labels}
                if not fam.add(fam.name, labels, dp.value):
                    _count(skipped, "duplicate series")
            return
        if isinstance(data, (Histogram, ExponentialHistogram)):
            fam = family(metric_name(m.name, m.unit, "histogram"), "histogram", help_text)
            if fam is None:
                return
            for dp in data.data_points:
                labels = {**_labels(dp.attributes), **scope_labels}
                labels.pop("le", None)  # the bucket label is ours
                if isinstance(data, Histogram):
                    cum, buckets = 0, []
                    for bound, c in zip(dp.explicit_bounds, dp.bucket_counts):
                        cum += c
                        if math.isfinite(bound):  # +Inf is emitted once, below, as the count
                            buckets.append((bound, cum))
                else:
                    buckets = _exp_buckets(dp)
                if not fam.reserve(fam.name + "_count", labels):
                    _count(skipped, "duplicate series")
                    continue
                for bound, cum in buckets:
                    fam.line(fam.name + "_bucket", {**labels, "le": _num(float(bound))}, cum)
                fam.line(fam.name + "_bucket", {**labels, "le": "+Inf"}, dp.count)
                if getattr(dp, "sum", None) is not None:
                    fam.line(fam.name + "_sum", labels, dp.sum)
                fam.line(fam.name + "_count", labels, dp.count)
            return
        _count(skipped, f"unsupported data {type(data).__name__}")

    for rm in (metrics_data.resource_metrics if metrics_data is not None else ()):
        attrs = getattr(rm.resource, "attributes", None) or {}
        target = {k: v for k, v in _labels(attrs).items() if k not in ("job", "instance")}
        if target and target not in targets:
            targets.append(target)
        for sm in rm.scope_metrics:
            scope = {}
            if sm.scope is not None and sm.scope.name:
                scope["otel_scope_name"] = sm.scope.name
                if sm.scope.version:
                    scope["otel_scope_version"] = sm.scope.version
            for m in sm.metrics:
                add_metric(m, scope)
    for m in extra:
        add_metric(m, {})

    out = []
    if targets and "target_info" not in families:
        out += ["# HELP target_info Target metadata", "# TYPE target_info gauge"]
        out += [f"target_info{_label_str(t)} 1" for t in targets]
    for fam in families.values():
        if not fam.lines:
            continue
        out.append(f"# HELP {fam.name} {_escape_help(fam.help)}")
        out.append(f"# TYPE {fam.name} {fam.type}")
        out += fam.lines
    return "\n".join(out) + "\n" if out else ""


# ---- the reader ------------------------------------------------------------------------------------

def _cumulative() -> dict[type, AggregationTemporality]:
    kinds = [SdkCounter, UpDownCounter, SdkHistogram, ObservableCounter, ObservableUpDownCounter, ObservableGauge]
    if SdkGauge is not None:
        kinds.append(SdkGauge)
    return dict.fromkeys(kinds, AggregationTemporality.CUMULATIVE)


class PrometheusReader(MetricReader):
    """A pull reader: each scrape() collects from the MeterProvider it is registered on (cumulative
    temporality for every instrument kind) and renders that, plus `extra()`'s metrics (e.g.
    histograms built elsewhere), as the text exposition. Thread-safe: one collection at a time.

    `skipped` counts what render() left out, by reason; `extra_failures` the scrapes whose extra()
    raised (then the SDK's metrics are served without them)."""

    def __init__(self, extra: Callable[[], list[Metric]] | None = None) -> None:
        super().__init__(preferred_temporality=_cumulative())
        self.extra = extra  # may be set after construction (before the first scrape)
        self._lock = threading.Lock()
        self._received: MetricsData | None = None
        self._shut = False
        self.skipped: Counter[str] = Counter()
        self.extra_failures = 0

    def _receive_metrics(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs) -> None:
        self._received = metrics_data  # under self._lock: only scrape() calls collect()

    def scrape(self) -> bytes:
        """Collect now and render: the body of one GET /metrics. Before the reader is registered on a
        MeterProvider, and after its shutdown, only extra()'s metrics are rendered."""
        with self._lock:
            self._received = None
            if not self._shut and self._collect is not None:
                self.collect()
            data, self._received = self._received, None
            extra: Sequence[Metric] = ()
            get_extra = self.extra
            if get_extra is not None:
                try:
                    extra = list(get_extra() or ())
                except Exception as e:  # noqa: BLE001 - the SDK's metrics are still served
                    self.extra_failures += 1
                    _log.warning("prometheus: extra metrics failed: %s: %s", type(e).__name__, e)
            return render(data, extra, self.skipped).encode("utf-8", "replace")

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True  # pulled: nothing is pending

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        with self._lock:
            self._shut = True


# ---- the server ------------------------------------------------------------------------------------

class ListenError(ValueError):
    """A listen address that is malformed or cannot be bound; str(): `'ADDR': reason`, one line."""

    def __init__(self, addr: str, reason: str) -> None:
        super().__init__(f"{str(addr)!r}: {reason}")
        self.reason = reason


def parse_listen(addr: str) -> tuple[str, int]:
    """`host:port`, `[v6]:port` or `:port` (every interface) -> (host, port). ListenError (one line)."""
    text = str(addr).strip()
    if text != addr or not text or any(c.isspace() or not c.isprintable() for c in text):
        raise ListenError(addr, "expected host:port, e.g. 127.0.0.1:9464 or [::1]:9464")
    if "/" in text:
        raise ListenError(addr, "expected host:port without a scheme or path, e.g. 127.0.0.1:9464")
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep or not host or "]" in host or "[" in host:
            raise ListenError(addr, "expected [IPv6 address]:port, e.g. [::1]:9464")
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            raise ListenError(addr, "no port; expected host:port, e.g. 127.0.0.1:9464")
        if ":" in host:
            raise ListenError(addr, "an IPv6 address needs brackets, e.g. [::1]:9464")
    if not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ListenError(addr, "port must be a number from 0 to 65535")
    if host and not re.fullmatch(r"[A-Za-z0-9.:%_-]+", host):
        raise ListenError(addr, f"{host!r} is not a host name or IP address")
    return host, int(port)


class _Handler(BaseHTTPRequestHandler):
    server: "_HTTPServer"
    # HTTP/1.0: one request per connection, so that close() leaves no connection being served
    timeout = 30  # a client that stalls mid-request frees its thread
    server_version = "mcp-agent"
    sys_version = ""

    def do_GET(self) -> None:  # noqa: N802
        self._serve(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._serve(body=False)

    def _serve(self, body: bool) -> None:
        owner = self.server.owner
        if self.path.split("?", 1)[0] != "/metrics":
            self._reply(404, b"404 not found: the metrics are at /metrics\n", "text/plain; charset=utf-8", body)
            return
        try:
            payload = owner._scrape()
        except Exception as e:  # noqa: BLE001 - a failed scrape is a 500, never a dead server
            owner._failed(e)
            self._reply(500, f"scrape failed: {type(e).__name__}\n".encode(), "text/plain; charset=utf-8", body)
            return
        owner._scraped()
        self._reply(200, payload, CONTENT_TYPE, body)

    def _reply(self, code: int, payload: bytes, ctype: str, body: bool) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if body:
            self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - no line per request
        pass


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    owner: "PrometheusServer"

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves its own name (socket.getfqdn: a DNS lookup); not needed
        if self.address_family == socket.AF_INET6:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def handle_error(self, request, client_address) -> None:  # a client that went away: not ours to print
        _log.debug("prometheus: connection from %s failed", client_address, exc_info=True)


class PrometheusServer:
    """GET /metrics on `listen` (host:port) from a daemon thread, answered with `scrape()`'s bytes.

    ListenError (a ValueError, one line) when the address is malformed, cannot be resolved or bound
    (in use, not this host's). `scrapes` / `scrape_failures` count answered and failed (500) scrapes. close() stops it
    and frees the port; closing twice is fine."""

    def __init__(self, listen: str, scrape: Callable[[], bytes]) -> None:
        host, port = parse_listen(listen)
        self.listen = listen
        self._scrape = scrape
        self._lock = threading.Lock()
        self.scrapes = 0
        self.scrape_failures = 0
        self.last_error: str | None = None
        try:
            infos = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0,
                                       socket.AI_PASSIVE | socket.AI_NUMERICSERV)
        except socket.gaierror as e:
            raise ListenError(listen, f"cannot resolve {host!r}: {e.strerror or e}") from None
        # ":9464": every interface, IPv4 and IPv6 (one dual-stack socket) where the host has IPv6; a
        # name with both (localhost): its IPv4 address, which is what 127.0.0.1-minded clients try
        infos.sort(key=lambda i: i[0] != (socket.AF_INET6 if not host else socket.AF_INET))
        family, _, _, _, sockaddr = infos[0]
        server_cls = type("_HTTPServerV", (_HTTPServer,), {"address_family": family})
        try:
            self._httpd = server_cls(sockaddr[:2] if family == socket.AF_INET else sockaddr, _Handler)
        except OSError as e:
            if not host and family == socket.AF_INET6 and e.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                server_cls = type("_HTTPServerV", (_HTTPServer,), {"address_family": socket.AF_INET})
                try:
                    self._httpd = server_cls(("0.0.0.0", port), _Handler)
                except OSError as e2:
                    raise ListenError(listen, self._bind_error(e2)) from None
            else:
                raise ListenError(listen, self._bind_error(e)) from None
        self._httpd.owner = self
        self.host = host
        self.port = self._httpd.server_address[1]
        self._closed = False
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="mcp-prometheus", daemon=True)
        self._thread.start()

    @staticmethod
    def _bind_error(e: OSError) -> str:
        why = {errno.EADDRINUSE: "address already in use", errno.EACCES: "permission denied",
               errno.EADDRNOTAVAIL: "address not available on this host"}.get(e.errno, e.strerror or str(e))
        return f"cannot listen: {why}"

    @property
    def url(self) -> str:
        host = self.host or str(self._httpd.server_address[0])
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/metrics"

    def _scraped(self) -> None:
        with self._lock:
            self.scrapes += 1

    def _failed(self, e: Exception) -> None:
        with self._lock:
            self.scrape_failures += 1
            first = self.scrape_failures == 1
        self.last_error = f"{type(e).__name__}: {e}"
        (_log.warning if first else _log.debug)("prometheus: scrape failed: %s", self.last_error, exc_info=first)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=2.0)
