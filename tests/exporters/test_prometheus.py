"""The Prometheus scrape endpoint: render() fed by a real SDK MeterProvider through PrometheusReader
(exact lines, checked by `promtool check metrics`), the HTTP server, the wiring (config, CLI,
build_exporters), and Debian's real `prometheus` scraping it and answering PromQL with our values."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import Counter, MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Buckets,
    ExponentialHistogram,
    ExponentialHistogramDataPoint,
    Gauge,
    InMemoryMetricReader,
    Metric,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, ExponentialBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from mcp_hostagent import config as C
from mcp_hostagent.exporters import Exporters, build_exporters, counting_only, from_config
from mcp_hostagent.exporters.prometheus import (
    CONTENT_TYPE,
    ListenError,
    PrometheusReader,
    PrometheusServer,
    label_name,
    metric_name,
    parse_listen,
    render,
)

IN_CI = os.environ.get("CI") == "true"
PROMETHEUS, PROMTOOL = "/usr/bin/prometheus", "/usr/bin/promtool"
SCOPE = 'otel_scope_name="t.scope",otel_scope_version="1.0"'
BOUNDS = (0.1, 0.5, 1.0, 5.0)
HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only: never an http_proxy


def need(path: str) -> None:
    """Debian's package `prometheus` ships both; scripts/setup.sh installs it, so CI must have it."""
    if not os.access(path, os.X_OK):
        msg = f"{path} not found: install Debian's package `prometheus` (apt-get install prometheus; scripts/setup.sh does)"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)


def promtool(text: str) -> tuple[int, str]:
    """`promtool check metrics` on text: exit 0 clean, 3 lint problems only, 1 the format is broken."""
    need(PROMTOOL)
    r = subprocess.run([PROMTOOL, "check", "metrics"], input=text.encode(), capture_output=True, timeout=60)
    return r.returncode, (r.stdout + r.stderr).decode(errors="replace")


def assert_promtool_clean(text: str) -> None:
    rc, out = promtool(text)
    assert rc == 0, out


def assert_promtool_parses(text: str) -> None:
    """Lint problems allowed (e.g. `use base unit seconds`), no format error."""
    rc, out = promtool(text)
    assert rc in (0, 3) and "error while linting" not in out and "parsing error" not in out, out


def provider(*, views=(), resource=None) -> tuple[MeterProvider, PrometheusReader]:
    reader = PrometheusReader()
    mp = MeterProvider(resource=resource or Resource({"service.name": "svc", "host.name": "h1"}),
                       metric_readers=[reader], views=list(views))
    return mp, reader


def body_lines(text: str) -> list[str]:
    assert text.endswith("\n") and "\r\n" not in text
    return text[:-1].split("\n")


def family(text: str, name: str) -> list[str]:
    """The lines of one family: its HELP, TYPE and samples, in order."""
    ls = body_lines(text)
    i = ls.index(next(ln for ln in ls if ln.startswith(f"# HELP {name} ")))
    j = i + 2
    while j < len(ls) and not ls[j].startswith("# HELP "):
        j += 1
    return ls[i:j]


# ---- names -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,unit,kind,expected", [
    ("hostagent.cuda.sync.time", "ns", "counter", "hostagent_cuda_sync_time_nanoseconds_total"),
    ("http.server.duration", "s", "histogram", "http_server_duration_seconds"),
    ("rpc.latency", "ms", "histogram", "rpc_latency_milliseconds"),
    ("hostagent.process.rss", "By", "gauge", "hostagent_process_rss_bytes"),
    ("gpu.clock", "MHz", "gauge", "gpu_clock_megahertz"),
    ("cpu.freq", "Hz", "gauge", "cpu_freq_hertz"),
    ("gpu.temperature", "Cel", "gauge", "gpu_temperature_celsius"),
    ("gpu.power", "W", "gauge", "gpu_power_watts"),
    ("gpu.power.draw", "mW", "gauge", "gpu_power_draw_milliwatts"),
    ("gpu.utilization", "%", "gauge", "gpu_utilization_percent"),
    ("cache.hit", "1", "gauge", "cache_hit_ratio"),
    ("events", "1", "counter", "events_total"),  # "1" -> ratio for gauges only
    ("faults", "{fault}", "counter", "faults_total"),
    ("packets", "{packet}/s", "gauge", "packets_per_second"),
    ("disk.io", "By/s", "gauge", "disk_io_bytes_per_second"),
    ("latency_seconds", "s", "gauge", "latency_seconds"),  # already there: not twice
    ("bytes_total", "By", "counter", "bytes_total"),  # _total goes last, once; the unit is there
    ("io.read", "By", "counter", "io_read_bytes_total"),
    ("requests_total", "", "counter", "requests_total"),
    ("x.seconds.max", "s", "gauge", "x_seconds_max"),  # the unit word anywhere in the name
    ("foo--bar..baz/qux", "", "gauge", "foo_bar_baz_qux"),
    ("9lives", "", "gauge", "_9lives"),
    ("ns:sub.name", "", "gauge", "ns:sub_name"),
    ("w", "weird unit!", "gauge", "w_weird_unit"),
    ("ünïcode.näme", "", "gauge", "n_code_n_me"),
])
def test_metric_name(name, unit, kind, expected):
    assert metric_name(name, unit, kind) == expected


def test_non_monotonic_sum_with_unit_1_gets_no_ratio():
    assert metric_name("q", "1", "gauge", is_gauge=False) == "q"
    assert metric_name("q", "1", "gauge", is_gauge=True) == "q_ratio"


@pytest.mark.parametrize("key,expected", [
    ("process.pid", "process_pid"), ("a..b", "a_b"), ("9x", "key_9x"), ("_x", "key_x"), ("__y", "key_y"),
    ("k8s.pod-name/ok", "k8s_pod_name_ok"), ("a:b", "a_b"), ("", "key_"), ("é", "key_"),
])
def test_label_name(key, expected):
    assert label_name(key) == expected


# ---- render, fed by a real MeterProvider ------------------------------------------------------------

def test_counter_gauge_updown_exact():
    mp, reader = provider()
    m = mp.get_meter("t.scope", "1.0")
    c = m.create_counter("hostagent.requests", unit="{request}", description="Requests served")
    c.add(5, {"route": "/a"})
    c.add(2, {"route": "/a"})
    c.add(1, {"route": "/b", "code": 200})
    m.create_observable_gauge("hostagent.gpu.temperature", [lambda o: [Observation(41.5, {"gpu": 0})]],
                              unit="Cel", description="GPU temperature")
    m.create_observable_counter("hostagent.cpu.time", [lambda o: [Observation(1.25)]], unit="s",
                                description="CPU time")
    u = m.create_up_down_counter("hostagent.open", unit="{request}", description="Open requests")
    u.add(3)
    u.add(-5)
    m.create_observable_gauge("hostagent.hit", [lambda o: [Observation(0.25, {"ok": True})]], unit="1",
                              description="A ratio")
    text = reader.scrape().decode()
    assert body_lines(text) == [
        "# HELP target_info Target metadata",
        "# TYPE target_info gauge",
        'target_info{service_name="svc",host_name="h1"} 1',
        "# HELP hostagent_requests_total Requests served",
        "# TYPE hostagent_requests_total counter",
        f'hostagent_requests_total{{route="/a",{SCOPE}}} 7',
        f'hostagent_requests_total{{route="/b",code="200",{SCOPE}}} 1',
        "# HELP hostagent_open Open requests",
        "# TYPE hostagent_open gauge",
        f"hostagent_open{{{SCOPE}}} -2",
        "# HELP hostagent_gpu_temperature_celsius GPU temperature",
        "# TYPE hostagent_gpu_temperature_celsius gauge",
        f'hostagent_gpu_temperature_celsius{{gpu="0",{SCOPE}}} 41.5',
        "# HELP hostagent_cpu_time_seconds_total CPU time",
        "# TYPE hostagent_cpu_time_seconds_total counter",
        f"hostagent_cpu_time_seconds_total{{{SCOPE}}} 1.25",
        "# HELP hostagent_hit_ratio A ratio",
        "# TYPE hostagent_hit_ratio gauge",
        f'hostagent_hit_ratio{{ok="true",{SCOPE}}} 0.25',
    ]
    assert_promtool_clean(text)
    c.add(3, {"route": "/a"})  # cumulative: the next scrape has the total
    assert f'hostagent_requests_total{{route="/a",{SCOPE}}} 10' in body_lines(reader.scrape().decode())
    assert reader.skipped == {}


def test_explicit_histogram_exact():
    mp, reader = provider(views=[View(instrument_name="hostagent.latency",
                                      aggregation=ExplicitBucketHistogramAggregation(BOUNDS))])
    h = mp.get_meter("t.scope", "1.0").create_histogram("hostagent.latency", unit="s", description="Latency")
    for v in (0.05, 0.2, 0.3, 0.3, 0.7, 2.0, 9.0):
        h.record(v, {"op": "read"})
    h.record(0.01, {"op": "write"})
    text = reader.scrape().decode()
    assert family(text, "hostagent_latency_seconds") == [
        "# HELP hostagent_latency_seconds Latency",
        "# TYPE hostagent_latency_seconds histogram",
        f'hostagent_latency_seconds_bucket{{op="read",{SCOPE},le="0.1"}} 1',
        f'hostagent_latency_seconds_bucket{{op="read",{SCOPE},le="0.5"}} 4',
        f'hostagent_latency_seconds_bucket{{op="read",{SCOPE},le="1"}} 5',
        f'hostagent_latency_seconds_bucket{{op="read",{SCOPE},le="5"}} 6',
        f'hostagent_latency_seconds_bucket{{op="read",{SCOPE},le="+Inf"}} 7',
        f'hostagent_latency_seconds_sum{{op="read",{SCOPE}}} {0.05 + 0.2 + 0.3 + 0.3 + 0.7 + 2.0 + 9.0!r}',
        f'hostagent_latency_seconds_count{{op="read",{SCOPE}}} 7',
        f'hostagent_latency_seconds_bucket{{op="write",{SCOPE},le="0.1"}} 1',
        f'hostagent_latency_seconds_bucket{{op="write",{SCOPE},le="0.5"}} 1',
        f'hostagent_latency_seconds_bucket{{op="write",{SCOPE},le="1"}} 1',
        f'hostagent_latency_seconds_bucket{{op="write",{SCOPE},le="5"}} 1',
        f'hostagent_latency_seconds_bucket{{op="write",{SCOPE},le="+Inf"}} 1',
        f'hostagent_latency_seconds_sum{{op="write",{SCOPE}}} 0.01',
        f'hostagent_latency_seconds_count{{op="write",{SCOPE}}} 1',
    ]
    assert_promtool_clean(text)


def parse_buckets(lines: list[str], sample: str) -> list[tuple[float, int]]:
    out = []
    for ln in lines:
        if ln.startswith(sample + "_bucket{"):
            le = ln.split('le="', 1)[1].split('"', 1)[0]
            out.append((float(le), int(ln.rsplit(" ", 1)[1])))
    return out


@pytest.mark.parametrize("max_size", [160, 8])  # 8: the SDK has to downscale to fit 1 ms .. 1000 s
def test_exponential_histogram_buckets(max_size):
    values = [0.0, 0.0, 0.001, 0.0015, 0.003, 0.02, 0.02, 0.5, 1.0, 1.0, 2.0, 3.7, 64.0, 1000.0]
    mp, reader = provider(views=[View(instrument_name="hostagent.exp",
                                      aggregation=ExponentialBucketHistogramAggregation(max_size=max_size))])
    h = mp.get_meter("t.scope", "1.0").create_histogram("hostagent.exp", unit="s", description="Exp")
    for v in values:
        h.record(v)
    text = reader.scrape().decode()
    fam = family(text, "hostagent_exp_seconds")
    assert fam[:2] == ["# HELP hostagent_exp_seconds Exp", "# TYPE hostagent_exp_seconds histogram"]
    buckets = parse_buckets(fam, "hostagent_exp_seconds")
    assert buckets[-1] == (math.inf, len(values))
    finite = buckets[:-1]
    assert finite, fam
    # the bounds are base**k for consecutive k, base = 2**(2**-scale), for one scale
    ratios = {round(b2 / b1, 9) for (b1, _), (b2, _) in zip(finite, finite[1:])}
    assert len(ratios) == 1, ratios
    (base,) = ratios
    scale = round(-math.log2(math.log2(base)))
    assert 2 ** (2 ** -scale) == pytest.approx(base)
    assert (max_size == 8) == (scale < 0)
    for le, _ in finite:
        k = math.log(le, base)
        assert k == pytest.approx(round(k), abs=1e-6), (le, base)
    # cumulative and correct: every bucket counts the values at or below its bound (zeros included)
    for le, n in finite:
        assert n == sum(v <= le * (1 + 1e-12) for v in values), (le, n, fam)
    assert finite[0][1] >= 2 + 1  # the zeros count into the first bucket, with the first value
    assert finite[-1][0] >= 1000.0 and finite[-1][1] == len(values)
    assert f"hostagent_exp_seconds_sum{{{SCOPE}}} {sum(values)!r}" in fam
    assert f"hostagent_exp_seconds_count{{{SCOPE}}} {len(values)}" in fam
    assert_promtool_clean(text)


def exp_point(**kw) -> ExponentialHistogramDataPoint:
    base = dict(attributes={}, start_time_unix_nano=1, time_unix_nano=2, count=0, sum=0, scale=0, zero_count=0,
                positive=Buckets(0, []), negative=Buckets(0, []), flags=0, min=0, max=0)
    return ExponentialHistogramDataPoint(**{**base, **kw})


def data_of(*metrics: Metric, resource=None, scope=("x", "")) -> MetricsData:
    return MetricsData([ResourceMetrics(resource or Resource({}),
                                        [ScopeMetrics(InstrumentationScope(*scope), list(metrics), "")], "")])


def test_exponential_zero_negative_and_leading_empty_buckets():
    # scale 0 (base 2): positive offset 1 -> bucket i holds (2**(1+i), 2**(2+i)]; two leading empties
    dp = exp_point(count=9, sum=10.0, scale=0, zero_count=2, positive=Buckets(1, [0, 0, 3, 0, 1]),
                   negative=Buckets(0, [3]))
    m = Metric("e", "E", "", ExponentialHistogram([dp], AggregationTemporality.CUMULATIVE))
    assert body_lines(render(data_of(m, scope=("", "")))) == [
        "# HELP e E", "# TYPE e histogram",
        'e_bucket{le="16"} 8',  # 3 negative + 2 zero + 3 in (8, 16]
        'e_bucket{le="32"} 8',
        'e_bucket{le="64"} 9',
        'e_bucket{le="+Inf"} 9',
        "e_sum 10", "e_count 9",
    ]
    # scale 2: bounds 2**((offset+i+1)/4); no positive buckets: only +Inf
    dp = exp_point(count=2, sum=0.5, scale=2, zero_count=0, positive=Buckets(-1, [1, 1]))
    lines = body_lines(render(data_of(Metric("f", "F", "", ExponentialHistogram([dp], AggregationTemporality.CUMULATIVE)),
                                      scope=("", ""))))
    assert lines[2:4] == ['f_bucket{le="1"} 1', f'f_bucket{{le="{2 ** 0.25!r}"}} 2']
    dp = exp_point(count=4, sum=0, zero_count=4)
    lines = body_lines(render(data_of(Metric("g", "G", "", ExponentialHistogram([dp], AggregationTemporality.CUMULATIVE)),
                                      scope=("", ""))))
    assert lines[2:] == ['g_bucket{le="+Inf"} 4', "g_sum 0", "g_count 4"]


HOSTILE = {
    "newline": "a\nb",
    "quote": 'say "hi"',
    "backslash": "C:\\path\\n not a newline",
    "mixed": '\\"\n\\n"',
    "control": "tab\there\rcr\x01\x1f\x7f end",
    "unicode": "grüße ✓ 🚀",
    "braces": '} 1\nfake_metric{x="y"} 2',
    "huge": "x" * 100_000,
    "empty": "",
}


def escaped(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def test_hostile_label_values_exact_and_parseable():
    mp, reader = provider()
    c = mp.get_meter("t.scope", "1.0").create_counter("hostagent.hostile", description='help with \\ and\nnewline')
    for k, v in HOSTILE.items():
        c.add(1, {"case": k, "value": v})
    c.add(2, {"case": "keys", "we!rd key": "1", "a.b": "x", "a_b": "y", "9": "z"})
    text = reader.scrape().decode()
    fam = family(text, "hostagent_hostile_total")
    assert fam[0] == "# HELP hostagent_hostile_total help with \\\\ and\\nnewline"
    samples = fam[2:]
    assert len(samples) == len(HOSTILE) + 1  # no value made a line of its own
    for (k, v), ln in zip(HOSTILE.items(), samples):
        assert ln == f'hostagent_hostile_total{{case="{k}",value="{escaped(v)}",{SCOPE}}} 1'
    # keys that sanitise alike are joined with ";" in the order of the original keys
    assert samples[-1] == f'hostagent_hostile_total{{case="keys",we_rd_key="1",a_b="x;y",key_9="z",{SCOPE}}} 2'
    assert_promtool_clean(text)


def test_unencodable_text_stays_valid_utf8():
    mp, reader = provider()
    c = mp.get_meter("t.scope", "1.0").create_counter("hostagent.surrogate", description="d")
    c.add(1, {"v": "bad \udcff surrogate"})
    body = reader.scrape()
    text = body.decode("utf-8")  # strict: raises if it is not UTF-8
    assert f'hostagent_surrogate_total{{v="bad ? surrogate",{SCOPE}}} 1' in text
    assert_promtool_clean(text)


def test_attribute_value_types():
    mp, reader = provider()
    c = mp.get_meter("t.scope", "1.0").create_counter("hostagent.t", description="d")
    c.add(1, {"i": -3, "f": 2.5, "t": True, "n": False, "seq": ("a", 'q"'), "nums": [1, 2]})
    (line,) = family(reader.scrape().decode(), "hostagent_t_total")[2:]
    assert line == ('hostagent_t_total{i="-3",f="2.5",t="true",n="false",seq="[\\"a\\", \\"q\\\\\\"\\"]",'
                    f'nums="[1, 2]",{SCOPE}}} 1')


def test_nan_and_infinities():
    # The SDK 1.45 drops non-finite observations, so they come from extra() (or a histogram's sum)
    vals = [(math.nan, {"k": "nan"}), (math.inf, {"k": "pinf"}), (-math.inf, {"k": "ninf"}),
            (1e20, {"k": "big"}), (-0.0, {"k": "negzero"}), (3, {"k": "int"}), (1e-7, {"k": "small"})]
    gauge = Metric("hostagent.g", "d", "", Gauge([NumberDataPoint(a, 1, 2, v) for v, a in vals]))
    mp, reader = provider()
    reader.extra = lambda: [gauge]
    mp.get_meter("t.scope", "1.0").create_observable_gauge(
        "hostagent.sdk", [lambda o: [Observation(v, a) for v, a in vals]], description="d")
    text = reader.scrape().decode()
    assert family(text, "hostagent_g")[2:] == [
        'hostagent_g{k="nan"} NaN', 'hostagent_g{k="pinf"} +Inf', 'hostagent_g{k="ninf"} -Inf',
        'hostagent_g{k="big"} 1e+20', 'hostagent_g{k="negzero"} 0', 'hostagent_g{k="int"} 3',
        'hostagent_g{k="small"} 1e-07',
    ]
    assert family(text, "hostagent_sdk")[2:] == [  # what the SDK kept
        f'hostagent_sdk{{k="big",{SCOPE}}} 1e+20', f'hostagent_sdk{{k="negzero",{SCOPE}}} 0',
        f'hostagent_sdk{{k="int",{SCOPE}}} 3', f'hostagent_sdk{{k="small",{SCOPE}}} 1e-07',
    ]
    assert_promtool_clean(text)


def test_milliseconds_lint_but_parse():
    mp, reader = provider()
    h = mp.get_meter("t.scope", "1.0").create_histogram("rpc.duration", unit="ms", description="d")
    h.record(3)
    text = reader.scrape().decode()
    assert "# TYPE rpc_duration_milliseconds histogram" in text
    assert_promtool_parses(text)  # promtool prefers base units, and says so: a lint remark, not an error


def collect(mp_reader_pairs) -> list[ResourceMetrics]:
    out = []
    for r in mp_reader_pairs:
        out += list(r.get_metrics_data().resource_metrics)
    return out


def test_resources_and_scopes_merge_into_one_family():
    readers = []
    for host in ("h1", "h2"):
        r = InMemoryMetricReader()
        mp = MeterProvider(resource=Resource({"service.name": "svc", "host.name": host, "job": "j", "instance": "i"}),
                           metric_readers=[r])
        for scope in ("s.one", "s.two"):
            mp.get_meter(scope).create_counter("hostagent.c", description="C").add(1, {"host": host})
        readers.append(r)
    skipped = {}
    text = render(MetricsData(collect(readers)), skipped=skipped)
    ls = body_lines(text)
    assert ls[:4] == ["# HELP target_info Target metadata", "# TYPE target_info gauge",
                      'target_info{service_name="svc",host_name="h1"} 1',  # no job, no instance
                      'target_info{service_name="svc",host_name="h2"} 1']
    assert ls[4:] == [
        "# HELP hostagent_c_total C", "# TYPE hostagent_c_total counter",
        'hostagent_c_total{host="h1",otel_scope_name="s.one"} 1',
        'hostagent_c_total{host="h1",otel_scope_name="s.two"} 1',
        'hostagent_c_total{host="h2",otel_scope_name="s.one"} 1',
        'hostagent_c_total{host="h2",otel_scope_name="s.two"} 1',
    ]
    assert ls.count("# TYPE hostagent_c_total counter") == 1 and skipped == {}
    assert_promtool_clean(text)


def test_duplicate_series_type_conflict_and_delta_are_skipped_and_counted():
    point = NumberDataPoint({"a": "1"}, 1, 2, 5)
    cum = Metric("m", "M", "", Sum([point], AggregationTemporality.CUMULATIVE, True))
    same = Metric("m", "M2", "", Sum([point], AggregationTemporality.CUMULATIVE, True))  # same series again
    clash = Metric("m_total", "M3", "", Gauge([NumberDataPoint({}, 1, 2, 1)]))  # m_total as a gauge
    delta = Metric("d", "D", "", Sum([point], AggregationTemporality.DELTA, True))
    skipped = {}
    text = render(data_of(cum, same, clash, delta, scope=("", "")), skipped=skipped)
    assert body_lines(text) == ["# HELP m_total M", "# TYPE m_total counter", 'm_total{a="1"} 5']
    assert skipped == {"duplicate series": 1, "type conflict": 1, "delta temporality": 1}


def test_delta_reader_data_is_skipped():
    r = InMemoryMetricReader(preferred_temporality={Counter: AggregationTemporality.DELTA})
    mp = MeterProvider(resource=Resource({}), metric_readers=[r])
    mp.get_meter("s").create_counter("c").add(3)
    mp.get_meter("s").create_up_down_counter("u").add(3)  # cumulative still
    skipped = {}
    text = render(r.get_metrics_data(), skipped=skipped)
    assert "c_total" not in text and 'u{otel_scope_name="s"} 3' in text
    assert skipped == {"delta temporality": 1}


def test_reader_is_cumulative_for_every_kind():
    reader = PrometheusReader()
    assert set(reader._instrument_class_temporality.values()) == {AggregationTemporality.CUMULATIVE}


def test_extra_metrics_and_extra_failure():
    calls = []

    def extra():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("bpf map gone")
        return [Metric("hostagent.kernel.lat", "Kernel latency", "s", ExponentialHistogram(
            [exp_point(count=3, sum=1.5, scale=0, positive=Buckets(-1, [2, 1]))], AggregationTemporality.CUMULATIVE))]

    mp, reader = provider()
    reader.extra = extra
    mp.get_meter("t.scope", "1.0").create_counter("hostagent.c", description="C").add(1)
    first = reader.scrape().decode()
    assert family(first, "hostagent_kernel_lat_seconds") == [
        "# HELP hostagent_kernel_lat_seconds Kernel latency", "# TYPE hostagent_kernel_lat_seconds histogram",
        'hostagent_kernel_lat_seconds_bucket{le="1"} 2', 'hostagent_kernel_lat_seconds_bucket{le="2"} 3',
        'hostagent_kernel_lat_seconds_bucket{le="+Inf"} 3', "hostagent_kernel_lat_seconds_sum 1.5",
        "hostagent_kernel_lat_seconds_count 3"]
    second = reader.scrape().decode()  # extra() raised: the SDK's metrics are still served
    assert "hostagent_kernel_lat_seconds" not in second and f"hostagent_c_total{{{SCOPE}}} 1" in second
    assert reader.extra_failures == 1
    assert "hostagent_kernel_lat_seconds_count 3" in reader.scrape().decode()


def test_reader_before_registration_and_after_shutdown():
    reader = PrometheusReader()
    assert reader.scrape() == b""  # not registered on a provider yet: nothing, no error
    mp = MeterProvider(resource=Resource({"service.name": "s"}), metric_readers=[reader])
    mp.get_meter("t").create_counter("c").add(1)
    assert b'c_total{otel_scope_name="t"} 1' in reader.scrape()
    mp.shutdown()
    assert reader.scrape() == b""


# ---- the server ------------------------------------------------------------------------------------

def get(url: str, timeout: float = 10):
    try:
        with HTTP.open(url, timeout=timeout) as r:
            return r.status, r.headers.get("Content-Type"), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type"), e.read()


@pytest.fixture
def server():
    made = []

    def make(scrape, listen="127.0.0.1:0"):
        s = PrometheusServer(listen, scrape)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def test_server_serves_metrics_404_and_500(server, capfd):
    mp, reader = provider()
    mp.get_meter("t.scope", "1.0").create_counter("hostagent.c", description="C").add(4)
    s = server(reader.scrape)
    assert s.url == f"http://127.0.0.1:{s.port}/metrics" and s.port > 0
    code, ctype, body = get(s.url)
    assert code == 200 and ctype == CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"
    assert f"hostagent_c_total{{{SCOPE}}} 4\n".encode() in body
    assert get(s.url + "?x=1")[0] == 200
    for path in ("/", "/metricsx", "/metrics/", "/favicon.ico"):
        assert get(f"http://127.0.0.1:{s.port}{path}")[0] == 404
    assert s.scrapes == 2 and s.scrape_failures == 0

    fail = {"on": True}

    def flaky():
        if fail["on"]:
            raise RuntimeError("collect exploded")
        return b"ok 1\n"

    f = server(flaky)
    code, _, body = get(f.url)
    assert code == 500 and b"RuntimeError" in body
    assert get(f.url)[0] == 500
    assert f.scrape_failures == 2 and f.scrapes == 0 and "collect exploded" in f.last_error
    fail["on"] = False  # the thread survived both
    assert get(f.url) == (200, CONTENT_TYPE, b"ok 1\n") and f.scrapes == 1
    err = capfd.readouterr().err
    assert "GET /metrics" not in err and '"GET' not in err  # no access log on stderr


def test_server_concurrent_scrapes(server):
    import threading

    mp, reader = provider()
    c = mp.get_meter("t.scope", "1.0").create_counter("hostagent.c", description="C")
    s = server(reader.scrape)
    results, errors = [], []

    def worker():
        for _ in range(20):
            c.add(1)
            try:
                code, _, body = get(s.url)
                results.append((code, body))
            except Exception as e:  # noqa: BLE001
                errors.append(e)

    ts = [threading.Thread(target=worker) for _ in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors and len(results) == 120 and all(code == 200 for code, _ in results)
    assert f"hostagent_c_total{{{SCOPE}}} 120".encode() in get(s.url)[2]
    assert s.scrapes == 121 and s.scrape_failures == 0


def test_server_busy_port_and_close_frees_it(server):
    s = server(lambda: b"")
    with pytest.raises(ListenError) as e:
        PrometheusServer(f"127.0.0.1:{s.port}", lambda: b"")
    assert str(e.value) == f"'127.0.0.1:{s.port}': cannot listen: address already in use"
    assert isinstance(e.value, ValueError)
    port = s.port
    s.close()
    s.close()  # twice is fine
    with pytest.raises(OSError):
        get(f"http://127.0.0.1:{port}/metrics", timeout=2)
    again = server(lambda: b"x 1\n", f"127.0.0.1:{port}")  # the port is free again
    assert get(again.url)[2] == b"x 1\n"


@pytest.mark.parametrize("addr,reason", [
    ("", "expected host:port"),
    ("127.0.0.1", "no port"),
    ("127.0.0.1:", "port must be a number"),
    ("127.0.0.1:99999", "port must be a number"),
    ("127.0.0.1:-1", "port must be a number"),
    ("127.0.0.1:http", "port must be a number"),
    ("::1:9464", "IPv6 address needs brackets"),
    ("[::1:9464", "expected [IPv6 address]:port"),
    ("[::1]", "expected [IPv6 address]:port"),
    (" 127.0.0.1:9464", "expected host:port"),
    ("127.0.0.1:9464\n", "expected host:port"),
    ("http://127.0.0.1:9464", "without a scheme or path"),
    ("127.0.0.1:9464/metrics", "without a scheme or path"),
    ("a_b!:1", "not a host name or IP address"),
])
def test_parse_listen_rejects(addr, reason):
    with pytest.raises(ListenError) as e:
        parse_listen(addr)
    assert reason in str(e.value) and "\n" not in str(e.value)


def test_parse_listen_accepts():
    assert parse_listen("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_listen("[::1]:9464") == ("::1", 9464)
    assert parse_listen(":9464") == ("", 9464)
    assert parse_listen("localhost:0") == ("localhost", 0)


def test_server_address_not_here():
    with pytest.raises(ListenError, match="cannot listen: address not available on this host"):
        PrometheusServer("192.0.2.1:0", lambda: b"")  # TEST-NET-1: never this host's


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback on this host")
def test_server_ipv6(server):
    s = server(lambda: b"v6 1\n", "[::1]:0")
    assert s.url == f"http://[::1]:{s.port}/metrics"
    assert get(s.url) == (200, CONTENT_TYPE, b"v6 1\n")


# ---- wiring ----------------------------------------------------------------------------------------

def test_build_exporters_with_prometheus():
    ex = build_exporters(None, None, prometheus_listen="127.0.0.1:0")
    try:
        (reader,) = ex.pull_readers
        assert isinstance(reader, PrometheusReader)
        (server,) = ex.servers
        assert ex.describe() == [f"prometheus: http://127.0.0.1:{server.port}/metrics"]
        mp = MeterProvider(resource=Resource({}), metric_readers=[*ex.pull_readers])
        mp.get_meter("t").create_counter("hostagent.c").add(2)
        assert get(server.url)[2] == b'# HELP hostagent_c_total hostagent.c\n# TYPE hostagent_c_total counter\n' \
                                     b'hostagent_c_total{otel_scope_name="t"} 2\n'
    finally:
        ex.close()
        ex.close()
    with pytest.raises(OSError):
        get(server.url, timeout=2)


def test_build_exporters_default_has_no_pull_reader():
    ex = build_exporters(None, None)
    assert ex.pull_readers == [] and ex.servers == []
    ex.close()
    only = counting_only()
    assert only.pull_readers == [] and isinstance(only, Exporters)
    only.close()


def test_non_loopback_sink_line_warns():
    ex = build_exporters(None, None, prometheus_listen=":0")
    try:
        (line,) = ex.describe()
        assert line.startswith("prometheus: http://") and "not loopback" in line
    finally:
        ex.close()


def test_build_exporters_closes_server_when_a_later_sink_fails(monkeypatch):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ValueError):
        build_exporters(None, "http://127.0.0.1:4318", "http/json", prometheus_listen=f"127.0.0.1:{port}")
    server = PrometheusServer(f"127.0.0.1:{port}", lambda: b"")  # not left bound by the failed build
    server.close()


def test_config_setting_env_file_and_flag(tmp_path):
    s = C.setting("export.prometheus_listen")
    assert (s.type, s.default, s.env) == ("str", "", "MCP_AGENT_EXPORT_PROMETHEUS_LISTEN")
    assert C.load_config(None, env={}).export_prometheus_listen == ""
    cfg = C.load_config(None, env={"MCP_AGENT_EXPORT_PROMETHEUS_LISTEN": "[::1]:9464"})
    assert cfg.export_prometheus_listen == "[::1]:9464"
    assert cfg.sources["export.prometheus_listen"] == "env:MCP_AGENT_EXPORT_PROMETHEUS_LISTEN"
    f = tmp_path / "c.toml"
    f.write_text('[export]\nprometheus_listen = "127.0.0.1:9464"\n')
    assert C.load_config(str(f), env={}).export_prometheus_listen == "127.0.0.1:9464"
    cfg = C.load_config(str(f), env={}, overrides={"export.prometheus_listen": "none"})
    assert cfg.export_prometheus_listen == "" and cfg.sources["export.prometheus_listen"] == "flag"
    with pytest.raises(C.ConfigError) as e:
        C.load_config(None, env={"MCP_AGENT_EXPORT_PROMETHEUS_LISTEN": "9464"})
    assert str(e.value) == ('config error: MCP_AGENT_EXPORT_PROMETHEUS_LISTEN="9464": '
                            "no port; expected host:port, e.g. 127.0.0.1:9464")
    f.write_text('[export]\nprometheus_listen = "::1:80"\n')
    with pytest.raises(C.ConfigError, match=r"export.prometheus_listen = \"::1:80\" \(from .*\): an IPv6 address needs"):
        C.load_config(str(f), env={})


def test_from_config_busy_port_is_a_config_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = C.load_config(None, env={}, overrides={"export.jsonl_path": "", "export.prometheus_listen": f"127.0.0.1:{port}"})
        with pytest.raises(C.ConfigError) as e:
            from_config(cfg)
    assert str(e.value) == (f'config error: export.prometheus_listen = "127.0.0.1:{port}" (from flag): '
                            "cannot listen: address already in use")
    cfg = C.load_config(None, env={}, overrides={"export.jsonl_path": "", "export.prometheus_listen": "127.0.0.1:0"})
    ex = from_config(cfg)
    try:
        assert len(ex.pull_readers) == 1 and ex.describe()[0].startswith("prometheus: http://127.0.0.1:")
    finally:
        ex.close()


def test_cli_flag_and_show_config():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MCP_AGENT_", "OTEL_"))}
    env["MCP_AGENT_CONFIG"] = os.devnull
    run = lambda *a: subprocess.run([sys.executable, "-m", "mcp_hostagent", "run", *a], env=env,
                                    capture_output=True, text=True, timeout=60)
    r = run("--show-config", "--prometheus", "127.0.0.1:9464")
    assert r.returncode == 0, r.stderr
    assert 'export.prometheus_listen = "127.0.0.1:9464" (flag)' in r.stdout.splitlines()
    r = run("--show-config")
    assert 'export.prometheus_listen = "" (default)' in r.stdout.splitlines()
    r = run("--show-config", "--prometheus", "localhost")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == ('mcp-agent: error: config error: export.prometheus_listen = '
                                                 '"localhost" (from flag): no port; expected host:port, e.g. 127.0.0.1:9464')
    assert "--prometheus ADDR" in run("--help").stdout


# ---- Debian's real prometheus scrapes us ---------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query(base: str, promql: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with HTTP.open(url, timeout=10) as r:
        doc = json.load(r)
    assert doc["status"] == "success", doc
    return doc["data"]["result"]


def wait_for(what: str, fn, proc, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited ({proc.returncode}) while waiting for {what}")
        try:
            got = fn()
            if got:
                return got
            last = got
        except (OSError, ValueError, KeyError, AssertionError) as e:
            last = e
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


@pytest.fixture
def prometheus(tmp_path):
    """Start /usr/bin/prometheus scraping `target` every second: start(target) -> (base URL, process)."""
    need(PROMETHEUS)
    procs = []

    def start(target: str) -> str:
        port = free_port()  # never Debian's 9090: a packaged service may hold it
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
            f"scrape_configs:\n  - job_name: mcp\n    static_configs:\n      - targets: ['{target}']\n")
        log = open(tmp_path / "prometheus.log", "wb")
        proc = subprocess.Popen([PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
        procs.append((proc, log))
        base = f"http://127.0.0.1:{port}"

        def ready():
            with HTTP.open(f"{base}/-/ready", timeout=2) as r:
                return r.status == 200
        wait_for("prometheus ready", ready, proc)
        return base, proc

    yield start
    for proc, log in procs:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
        log.close()


def test_real_prometheus_scrapes_and_queries(prometheus, server, tmp_path):
    mp, reader = provider(
        resource=Resource({"service.name": "mcp-agent", "host.name": "e2e-host"}),
        views=[View(instrument_name="hostagent.latency", aggregation=ExplicitBucketHistogramAggregation(BOUNDS)),
               View(instrument_name="hostagent.exp", aggregation=ExponentialBucketHistogramAggregation(max_size=40))])
    m = mp.get_meter("t.scope", "1.0")
    m.create_counter("hostagent.requests", unit="{request}", description="Requests").add(7, {"route": "/gen"})
    m.create_observable_gauge("hostagent.gpu.temperature", [lambda o: [Observation(63.5, {"gpu": "0"})]],
                              unit="Cel", description="GPU temperature")
    lat = m.create_histogram("hostagent.latency", unit="s", description="Latency")
    for v in (0.2, 0.3, 0.4, 0.45, 2.0):  # median in (0.1, 0.5], p99 in (1, 5]
        lat.record(v)
    exp = m.create_histogram("hostagent.exp", unit="s", description="Exponential latency")
    for v in (0.004, 0.005, 0.006, 0.0065, 0.3):  # median in the bucket of 0.005 (+/- one bucket width)
        exp.record(v)
    hostile = {k: v for k, v in HOSTILE.items() if k != "huge"} | {"big": "y" * 10_000}
    c = m.create_counter("hostagent.hostile", description="Hostile label values")
    for k, v in hostile.items():
        c.add(1, {"case": k, "value": v})

    s = server(reader.scrape)
    base, proc = prometheus(f"127.0.0.1:{s.port}")

    def up():
        r = query(base, 'up{job="mcp"}')
        return r and r[0]["value"][1] == "1" and r
    got = wait_for("up == 1", up, proc)
    assert got[0]["metric"]["instance"] == f"127.0.0.1:{s.port}"

    def one(promql):
        r = query(base, promql)
        assert len(r) == 1, (promql, r)
        return r[0]

    r = one('hostagent_requests_total{job="mcp"}')
    assert r["value"][1] == "7"
    assert r["metric"] == {"__name__": "hostagent_requests_total", "job": "mcp", "instance": f"127.0.0.1:{s.port}",
                           "route": "/gen", "otel_scope_name": "t.scope", "otel_scope_version": "1.0"}
    assert one("hostagent_gpu_temperature_celsius")["value"][1] == "63.5"
    assert one("hostagent_latency_seconds_count")["value"][1] == "5"
    assert float(one("hostagent_latency_seconds_sum")["value"][1]) == pytest.approx(3.35)
    q50 = float(one("histogram_quantile(0.5, sum by (le) (hostagent_latency_seconds_bucket))")["value"][1])
    assert 0.1 < q50 <= 0.5, q50
    q99 = float(one("histogram_quantile(0.99, sum by (le) (hostagent_latency_seconds_bucket))")["value"][1])
    assert 1.0 < q99 <= 5.0, q99
    qe = float(one("histogram_quantile(0.5, sum by (le) (hostagent_exp_seconds_bucket))")["value"][1])
    assert 0.004 < qe < 0.0075, qe
    assert one("hostagent_exp_seconds_count")["value"][1] == "5"
    t = one('target_info{job="mcp"}')["metric"]
    assert t["service_name"] == "mcp-agent" and t["host_name"] == "e2e-host" and t["instance"] == f"127.0.0.1:{s.port}"

    rows = query(base, "hostagent_hostile_total")
    # every value round-trips (an empty one is no label at all, in Prometheus)
    assert {r["metric"]["case"]: r["metric"].get("value", "") for r in rows} == hostile
    assert "value" not in next(r["metric"] for r in rows if r["metric"]["case"] == "empty")
    assert all(r["value"][1] == "1" for r in rows)
    # Prometheus took every sample of our exposition
    samples = [ln for ln in body_lines(reader.scrape().decode()) if not ln.startswith("#")]
    assert one('scrape_samples_scraped{job="mcp"}')["value"][1] == str(len(samples))
    assert s.scrape_failures == 0 and s.scrapes >= 1
