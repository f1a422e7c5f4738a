"""packaging/prometheus/rules.yml and packaging/grafana/mcp-agent-dashboard.json against the agent.

- `promtool check rules` on the rules, and `promtool test rules` on packaging/prometheus/rules_test.yml,
  whose input series use the names the endpoint serves: every alert is seen firing and not firing.
- Every metric name a rule or a dashboard panel uses is one the agent exports: the instruments the
  capabilities declare, translated by exporters/prometheus.py's own metric_name() (and checked against
  a real render of a Telemetry carrying them all), plus `up` and `target_info`. Label names likewise.
  The rules are read as Debian's real Prometheus loads them (its /api/v1/rules), not by a YAML
  parser of ours.
- The dashboard: valid JSON, unique panel ids, datasources only through the ${DS_PROMETHEUS} /
  ${DS_TEMPO} variables, and every PromQL expression accepted by `promtool check rules` (each put into
  a temporary rules file as a recording rule, template variables replaced first).

Debian's package `prometheus` ships promtool and prometheus; without it these tests skip, and fail
when CI=true (scripts/setup.sh installs it), as tests/exporters/test_prometheus.py does.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from mcp_hostagent.exporters.prometheus import PrometheusReader, label_name, metric_name

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "packaging" / "prometheus" / "rules.yml"
RULES_TEST = REPO / "packaging" / "prometheus" / "rules_test.yml"
DASHBOARD = REPO / "packaging" / "grafana" / "mcp-agent-dashboard.json"
AGENT_SRC = REPO / "agent"

IN_CI = os.environ.get("CI") == "true"
PROMETHEUS, PROMTOOL = "/usr/bin/prometheus", "/usr/bin/promtool"
HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only: never an http_proxy

# Instrument kind -> metric_name()'s kind. "log2_ns" is a histogram the kernel bucketed (no _sum).
KIND = {"counter": "counter", "gauge": "gauge", "histogram": "histogram", "log2_ns": "histogram"}
# Series that are not the agent's instruments but that a rule or panel may use.
NOT_INSTRUMENTS = {"up", "target_info"}
# Labels Prometheus or the endpoint add to every agent series, and histogram buckets' own.
BASE_LABELS = {"job", "instance", "le", "otel_scope_name", "otel_scope_version", "__name__"}
SEVERITIES = {"critical", "warning", "info"}


def need(path: str) -> None:
    """Debian's package `prometheus` ships both; scripts/setup.sh installs it, so CI must have it."""
    if not os.access(path, os.X_OK):
        msg = (f"{path} not found: install Debian's package `prometheus` "
               "(apt-get install prometheus; scripts/setup.sh does)")
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)


def promtool(*args: str, cwd: Path | None = None) -> tuple[int, str]:
    need(PROMTOOL)
    r = subprocess.run([PROMTOOL, *args], capture_output=True, timeout=120, cwd=cwd)
    return r.returncode, (r.stdout + r.stderr).decode(errors="replace")


# ---- what the agent exports ------------------------------------------------------------------------

def declared_instruments() -> list:
    """The Instrument declarations of every capability, as agent/catalog.py gathers them from an agent
    made with the default config and nothing behind it (their read functions are never called)."""
    from mcp_hostagent.catalog import all_instruments

    insts = all_instruments()
    out = {}
    for i in insts:
        out.setdefault(i.name, i)
    return list(out.values())


def translated(inst) -> tuple[str, set[str]]:
    """(family, sample names) of an instrument, by exporters/prometheus.py's metric_name()."""
    fam = metric_name(inst.name, inst.unit, KIND[inst.kind])
    if inst.kind == "histogram":
        return fam, {fam + "_bucket", fam + "_sum", fam + "_count"}
    if inst.kind == "log2_ns":  # the kernel keeps no sum
        return fam, {fam + "_bucket", fam + "_count"}
    return fam, {fam}


def _telemetry(reader):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from mcp_hostagent.core.timebase import Timebase
    from mcp_hostagent.exporters import Exporters
    from mcp_hostagent.exporters.counting import CountingSpanExporter, ExportStats
    from mcp_hostagent.telemetry.otel import Telemetry

    stats = ExportStats()
    ex = Exporters(CountingSpanExporter(InMemorySpanExporter(), stats), [], stats, pull_readers=[reader])
    return Telemetry(service_name="mcp-agent", exporters=ex, timebase=Timebase(0))


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^\n]*\})? \S+$")
_TYPE = re.compile(r"^# TYPE (\S+) (\S+)$")


def _parse(text: str) -> tuple[dict[str, str], set[str], dict[str, set[str]]]:
    """(family -> type, sample names, sample name -> label names) of an exposition."""
    types, samples, labels = {}, set(), {}
    for line in text.splitlines():
        m = _TYPE.match(line)
        if m:
            types[m.group(1)] = m.group(2)
            continue
        if line.startswith("#") or not line:
            continue
        m = _SAMPLE.match(line)
        assert m, line
        samples.add(m.group(1))
        labels.setdefault(m.group(1), set()).update(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(2) or ""))
    return types, samples, labels


@pytest.fixture(scope="module")
def rendered():
    """The real endpoint's view: a Telemetry (agent/telemetry/otel.py) declaring every instrument, each
    observed once (synthetic rows), and agent/cli.py's _reload_metrics on another one, scraped through
    PrometheusReader. -> (family -> type, sample names, sample -> labels)."""
    from mcp_hostagent import cli
    from mcp_hostagent.telemetry.spec import Log2Buckets

    insts = declared_instruments()
    reader = PrometheusReader()
    t = _telemetry(reader)
    decl = []
    for i in insts:
        if i.kind == "log2_ns":
            decl.append(dataclasses.replace(i, read=lambda: [(Log2Buckets({10: 1, 20: 2}), {"hostagent.test": "x"})]))
        elif i.kind == "histogram":
            decl.append(i)
        else:
            decl.append(dataclasses.replace(i, read=lambda: [(1, {"hostagent.test": "x"})]))
    try:
        t.declare(decl)
        for i in insts:
            if i.kind == "histogram":
                t.record(i.name, 0.25, {"hostagent.test": "x"})
                t.record(i.name, 1.5, {"hostagent.test": "x"})
        text = reader.scrape().decode()
    finally:
        t.shutdown()
    # the CLI's own (SIGHUP reload counts), declared however _reload_metrics declares them
    reader2 = PrometheusReader()
    t2 = _telemetry(reader2)
    try:
        cli._reload_metrics(SimpleNamespace(telemetry=t2), {"ok": 1, "failed": 1})
        text2 = reader2.scrape().decode()
    finally:
        t2.shutdown()
    types, samples, labels = _parse(text)
    types2, samples2, labels2 = _parse(text2)
    assert reader.skipped == {} and reader2.skipped == {}
    return {**types, **types2}, samples | samples2, {**labels, **labels2}


@pytest.fixture(scope="module")
def exported(rendered) -> set[str]:
    """Every sample name the agent can serve: the translation of the declared instruments, and what
    the real render served (the CLI's reload counters included)."""
    names = set(rendered[1])
    for inst in declared_instruments():
        names |= translated(inst)[1]
    return names


def attribute_literals() -> set[str]:
    """Every dotted attribute-like string literal in agent/ (AST constants, f-strings' literal parts
    excluded): the keys the instruments' rows use are among them."""
    out = set()
    pattern = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z0-9_]+)+$")
    for path in AGENT_SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.match(node.value):
                out.add(node.value)
    return out


@pytest.fixture(scope="module")
def allowed_labels(rendered) -> set[str]:
    """Label names a selector or grouping may use: the agent's attribute keys as label_name() makes
    them, target_info's resource labels, and what Prometheus / the endpoint add."""
    labels = {label_name(k) for k in attribute_literals()} | BASE_LABELS
    labels |= rendered[2].get("target_info", set())
    return labels


# ---- PromQL: the names an expression uses ----------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{([^{}]*)\}")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_IDENT = re.compile(r"(?<![A-Za-z0-9_:.])([A-Za-z_:][A-Za-z0-9_:]*)(?![A-Za-z0-9_:])(?!\s*\()")
_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "offset",
             "bool", "inf", "nan", "atan2", "start", "end"}


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) an expression uses. Strings are blanked first (a label value or a
    regex never counts), then label names are taken from matchers and grouping lists and those removed,
    then every identifier that is not a function call, keyword, number or duration is a metric name.
    Syntax itself is promtool's to check."""
    text = _STRING.sub('""', expr)
    labels = set()
    for m in _MATCHERS.finditer(text):
        labels |= {x.split("=")[0].split("!")[0].strip() for x in m.group(1).split(",") if x.strip()}
    text = _MATCHERS.sub(" ", text)
    for m in _GROUPING.finditer(text):
        labels |= {x.strip() for x in m.group(1).split(",") if x.strip()}
    text = _RANGE.sub(" ", _GROUPING.sub(" ", text))
    metrics = {m for m in _IDENT.findall(text) if m.lower() not in _KEYWORDS}
    return metrics, labels


def test_promql_names_reads_what_it_should():
    expr = ('sum by (job, le) (rate(a_total{x="b_total", y=~"c|d"}[5m] offset 1h)) / on (job) group_left (z) '
            'max without (w) (e_bucket) > 1e9 unless f:g:h and histogram_quantile(0.99, i) or vector(1)')
    assert promql_names(expr) == ({"a_total", "e_bucket", "f:g:h", "i"}, {"job", "le", "x", "y", "z", "w"})


# ---- the rules -------------------------------------------------------------------------------------

def test_promtool_check_rules():
    rc, out = promtool("check", "rules", str(RULES))
    assert rc == 0 and "SUCCESS" in out, out


def test_promtool_unit_tests_pass():
    """Each alert fires on the input series that should fire it, and not on the others (rules_test.yml)."""
    rc, out = promtool("test", "rules", RULES_TEST.name, cwd=RULES_TEST.parent)
    assert rc == 0 and "SUCCESS" in out, out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def loaded_rules(tmp_path_factory) -> list[dict]:
    """The rules as Debian's Prometheus loads them: its /api/v1/rules (name, query, duration, labels,
    annotations of every rule), from a server on a free loopback port with its TSDB in a temporary
    directory."""
    need(PROMETHEUS)
    tmp = tmp_path_factory.mktemp("prometheus")
    cfg = tmp / "prometheus.yml"
    cfg.write_text(json.dumps({"global": {"evaluation_interval": "1h"}, "rule_files": [str(RULES)]}))
    port = _free_port()
    log = open(tmp / "log", "wb")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
    try:
        deadline, last = time.monotonic() + 60, None
        while True:
            assert proc.poll() is None, f"prometheus exited ({proc.returncode}): {(tmp / 'log').read_text()}"
            try:
                with HTTP.open(f"http://127.0.0.1:{port}/api/v1/rules", timeout=2) as r:
                    body = json.load(r)
                groups = body["data"]["groups"]
                if groups:
                    break
            except (OSError, ValueError, KeyError) as e:
                last = e
            assert time.monotonic() < deadline, f"prometheus never served the rules: {last!r}"
            time.sleep(0.3)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    return [dict(rule, group=g["name"]) for g in groups for rule in g["rules"]]


def test_rules_loaded_whole(loaded_rules):
    """The server loaded every rule of the file (none dropped), alerting and recording."""
    text = RULES.read_text()
    assert len(loaded_rules) == len(re.findall(r"^\s+- (?:alert|record): ", text, re.M))
    assert {r["type"] for r in loaded_rules} == {"alerting", "recording"}


def test_rules_use_only_exported_metrics_and_labels(loaded_rules, exported, allowed_labels):
    recorded = {r["name"] for r in loaded_rules if r["type"] == "recording"}
    unknown_metrics, unknown_labels = {}, {}
    for r in loaded_rules:
        metrics, labels = promql_names(r["query"])
        bad = metrics - exported - recorded - NOT_INSTRUMENTS
        if bad:
            unknown_metrics[r["name"]] = sorted(bad)
        bad = labels - allowed_labels
        if bad:
            unknown_labels[r["name"]] = sorted(bad)
    assert unknown_metrics == {}, "metrics the agent does not export (renamed?)"
    assert unknown_labels == {}, "labels no agent series carries"


def test_recording_rules_are_named_level_metric_operation(loaded_rules):
    for r in loaded_rules:
        if r["type"] == "recording":
            assert re.fullmatch(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+", r["name"]), r["name"]


def test_every_alert_has_for_severity_and_says_what_to_look_at(loaded_rules):
    alerts = [r for r in loaded_rules if r["type"] == "alerting"]
    assert len(alerts) >= 15
    for a in alerts:
        assert a["duration"] > 0, f"{a['name']}: no `for:`"
        assert a["labels"].get("severity") in SEVERITIES, a["name"]
        ann = a["annotations"]
        assert ann.get("summary") and ann.get("description"), a["name"]
        assert len(ann["description"]) > 80, f"{a['name']}: the description should say what to look at next"
        assert "Next:" in ann["description"], a["name"]
        assert a["name"].startswith("Hostagent"), a["name"]


def test_alerts_cover_what_an_sre_needs(loaded_rules):
    """The signals asked for, each used by an alert (by metric: the alert names may change)."""
    used = set()
    for r in loaded_rules:
        if r["type"] == "alerting":
            used |= promql_names(r["query"])[0]
    for metric in ("hostagent_reclaim_storm_active", "hostagent_pcie_link_episode_active",
                   "hostagent_pcie_aer_errors_total", "hostagent_gpu_xid_errors_total", "hw_status",
                   "hostagent_agent_events_lost_total", "hostagent_agent_spans_dropped_total",
                   "hostagent_agent_probes", "up"):
        assert metric in used, f"no alert on {metric}"
    gpu_down = [r for r in loaded_rules if "hw_status" in r["query"]]
    assert any('hw_state="failed"' in r["query"] for r in gpu_down)


def test_unit_tests_see_every_alert_fire_and_not_fire():
    """rules_test.yml has, for every alert of rules.yml, an evaluation expecting it and one expecting
    nothing (before its `for:`, after recovery, or on series that must not match)."""
    alerts = set(re.findall(r"^\s+- alert: (\S+)", RULES.read_text(), re.M))
    tests = RULES_TEST.read_text()
    cases = re.findall(r"alertname: (\S+)\n\s+exp_alerts:( \[\])?", tests)
    firing = {name for name, empty in cases if not empty}
    quiet = {name for name, empty in cases if empty}
    assert alerts - firing == set(), "alerts never seen firing"
    assert alerts - quiet == set(), "alerts never seen staying quiet"
    assert {name for name, _ in cases} <= alerts, "tests of alerts that do not exist"


def test_unit_test_inputs_use_exported_names(exported, allowed_labels):
    """The input series of rules_test.yml are named and labelled as the agent serves them, so a test
    that passes says something about the real series."""
    names = re.findall(r"series: '([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}'", RULES_TEST.read_text())
    assert names
    for name, labels in names:
        assert name in exported | NOT_INSTRUMENTS, name
        keys = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', labels))
        assert keys <= allowed_labels, (name, keys - allowed_labels)


# ---- the names: translation and the real endpoint agree ----------------------------------------------

def test_metric_name_translation_matches_the_real_endpoint(rendered):
    """metric_name() of every declared instrument is a family the real render serves, of the type its
    kind says, with the samples translated() expects (no _sum for the kernel's log2 histograms)."""
    types, samples, _ = rendered
    insts = declared_instruments()
    assert len(insts) >= 40
    for inst in insts:
        fam, names = translated(inst)
        want = {"counter": "counter", "gauge": "gauge", "histogram": "histogram", "log2_ns": "histogram"}[inst.kind]
        assert types.get(fam) == want, (inst.name, fam, types.get(fam))
        assert names <= samples, (inst.name, names - samples)
        if inst.kind == "log2_ns":
            assert fam + "_sum" not in samples
    assert "target_info" in types


def test_names_the_task_relies_on(exported):
    """A few names as an SRE would type them (docs/PROMETHEUS.md)."""
    for name in ("hostagent_reclaim_storm_active", "hostagent_agent_events_lost_total", "hw_gpu_utilization_ratio",
                 "hostagent_request_duration_seconds_bucket", "hostagent_reclaim_stall_duration_seconds_bucket",
                 "hostagent_process_reclaim_stall_time_seconds_total", "hostagent_agent_config_reload_failed_total"):
        assert name in exported, name
    assert "hostagent_reclaim_stall_duration_seconds_sum" not in exported


# ---- the dashboard ---------------------------------------------------------------------------------

def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(panels: list) -> list[dict]:
    out = []
    for p in panels:
        out.append(p)
        out += all_panels(p.get("panels", []))
    return out


def prom_targets(d: dict) -> list[tuple[str, str]]:
    """(where, expr) of every PromQL expression of the dashboard: panel targets, annotations."""
    out = []
    for p in all_panels(d["panels"]):
        for t in p.get("targets", []):
            ds = t.get("datasource") or p.get("datasource") or {}
            if ds.get("type") == "prometheus":
                out.append((f"panel {p['id']} {p['title']!r} {t['refId']}", t["expr"]))
    for a in d.get("annotations", {}).get("list", []):
        if a.get("datasource", {}).get("type") == "prometheus":
            out.append((f"annotation {a['name']!r}", a["expr"]))
    return out


_VAR = re.compile(r"\$\{?(__rate_interval|__interval|__range|[A-Za-z_][A-Za-z0-9_]*)(?::[a-z]+)?\}?")


def substitute(expr: str) -> str:
    """Grafana's variables as Prometheus would get them: intervals as a duration, the rest as a regex."""
    return _VAR.sub(lambda m: "5m" if m.group(1).startswith("__") else ".*", expr)


def test_dashboard_parses_with_unique_panel_ids_and_sane_layout():
    d = dashboard()
    assert 36 <= d["schemaVersion"] <= 41
    assert d["uid"] and d["title"]
    panels = all_panels(d["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    cells = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] >= 1 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['id']} {p['title']!r} overlaps another"
                cells.add((x, y))
    rows = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert rows == ["Host memory pressure", "Processes", "GPUs", "PCIe / NIC", "Requests", "Agent health"]


def test_dashboard_datasources_are_variables():
    d = dashboard()
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert variables["DS_TEMPO"]["type"] == "datasource" and variables["DS_TEMPO"]["query"] == "tempo"
    assert {"instance", "executable"} <= set(variables)
    uids = {"prometheus": "${DS_PROMETHEUS}", "tempo": "${DS_TEMPO}"}
    for p in all_panels(d["panels"]):
        if p["type"] == "row":
            continue
        for ds in [p["datasource"], *(t.get("datasource") for t in p.get("targets", []))]:
            assert ds is not None and ds["uid"] == uids[ds["type"]], (p["id"], ds)
    tempo = [p for p in all_panels(d["panels"]) if p.get("datasource", {}).get("type") == "tempo"]
    assert tempo and all(t["queryType"] == "traceql" and t["query"] for p in tempo for t in p["targets"])


def test_dashboard_uses_only_exported_metrics_and_labels(exported, allowed_labels):
    d = dashboard()
    exprs = prom_targets(d)
    assert len(exprs) >= 50
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*([a-zA-Z_][a-zA-Z0-9_]*)\)", v["definition"])
            assert m, v["definition"]
            exprs.append((f"variable {v['name']}", m.group(1)))
            assert m.group(2) in allowed_labels, v["name"]
    bad = {}
    for where, expr in exprs:
        metrics, labels = promql_names(substitute(expr))
        wrong = (metrics - exported - NOT_INSTRUMENTS) | (labels - allowed_labels)
        if wrong:
            bad[where] = sorted(wrong)
        assert metrics, where
    assert bad == {}, "metrics or labels the agent does not export"


def test_dashboard_promql_is_valid(tmp_path):
    """Every expression (variables replaced) as a recording rule of a temporary rules file (JSON: YAML's
    subset), checked by promtool."""
    exprs = prom_targets(dashboard())
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr_{n}:check", "expr": substitute(expr)} for n, (_, expr) in enumerate(exprs)]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(json.dumps(rules, indent=1))
    rc, out = promtool("check", "rules", str(path))
    if rc != 0:
        where = dict(enumerate(w for w, _ in exprs))
        hint = "\n".join(f"  expr_{n} = {where[n]}" for n in map(int, re.findall(r"expr_(\d+)", out)))
        pytest.fail(f"promtool rejects dashboard PromQL:\n{out}\n{hint}")
    assert f"SUCCESS: {len(exprs)} rules found" in out, out
