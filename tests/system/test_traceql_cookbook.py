"""docs/TRACEQL.md (and the TraceQL in packaging/prometheus/rules.yml's annotations and the Grafana
dashboard's Tempo panels) against the spans the agent exports.

Every span name (`name = "..."`), event name (`event:name = "..."`) and attribute (`span.X`,
`resource.X`, `event.X`, `link.X`) must exist, in that scope. The names come from spans exported for
real, without BPF: the agent's own span builders (request_span with every counter and the evidence of
each capability's own evidence(): reclaim, GPU, PCIe, NIC, CUDA findings; step_span; storm_span and
episode_attributes; LinkEpisodeSpans) run through a real Telemetry (agent/telemetry/otel.py) into an
in-memory exporter. Only the capabilities' state is faked (a storm episode, a GPU sample, an AER
record, a NIC event); the names, the scopes (the process identity on the resource) and the way
events and links are attached are the code's. Attributes named dynamically are checked by their
prefix against the code's lists: `hostagent.gpu.<index>.*` (GpuAggregate.attributes),
`hostagent.storm.*` (memstat.VMSTAT_KEYS), `hostagent.finding.*` (cuda.steps.FINDING_SHARES),
`hostagent.pcie.aer.*` (sysfs AER_FILES). Event attributes of sources the harness does not drive also
count when the code names them in an event (AST: EventSpec(...), telemetry.event(...), and the
(name, t, ..., attributes) tuples the capabilities keep).

Each query must balance its braces, parentheses and quotes.
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import unstarted_agent

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "TRACEQL.md"
RULES = REPO / "packaging" / "prometheus" / "rules.yml"
DASHBOARD = REPO / "packaging" / "grafana" / "mcp-agent-dashboard.json"
AGENT_SRC = REPO / "agent"

GPU_BDF, BRIDGE_BDF = "0000:3b:00.0", "0000:3a:00.0"
POD_UID = "6b1f0c1e-3d2a-4c55-9f1e-2a7d0e9b8c11"
CONTAINER = "3f2c9d1e8a7b" + "0" * 52
CGROUP = (f"/kubepods.slice/kubepods-pod{POD_UID.replace('-', '_')}.slice/"
          f"cri-containerd-{CONTAINER}.scope")
INTRINSICS = {"name", "duration", "status", "kind", "statusMessage", "rootName", "rootServiceName",
              "traceDuration", "nestedSetParent", "nestedSetLeft", "nestedSetRight"}


# ---- spans, exported for real ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported():
    """What the agent's span code exports, by scope: span names, span attributes by span name, resource
    attributes by span name, event names and their attributes, link attributes."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from mcp_hostagent.core.capability import Evidence
    from mcp_hostagent.core.decode import COUNTER_FIELDS, Counters, Header
    from mcp_hostagent.core.identity import ProcessInfo, ProcessRegistry
    from mcp_hostagent.core.timebase import Timebase
    from mcp_hostagent.cuda import telemetry as cuda_t
    from mcp_hostagent.cuda.steps import GpuStep
    from mcp_hostagent.exporters import Exporters
    from mcp_hostagent.exporters.counting import CountingSpanExporter, ExportStats
    from mcp_hostagent.gpuhealth.nvml import GpuAggregate
    from mcp_hostagent.gpuhealth.xid import XidEvent
    from mcp_hostagent.nic.netlink import LinkEvent
    from mcp_hostagent.pcie import telemetry as pcie_t
    from mcp_hostagent.pcie.episodes import LinkEpisode
    from mcp_hostagent.pcie.records import AerRecord, LinkEventRecord
    from mcp_hostagent.reclaim import memstat
    from mcp_hostagent.reclaim import telemetry as reclaim_t
    from mcp_hostagent.reclaim.oom import OomKill
    from mcp_hostagent.reclaim.records import ReclaimStall
    from mcp_hostagent.reclaim.rule import Episode
    from mcp_hostagent.core.request import FinishedRequest
    from mcp_hostagent.core.traceparent import TraceParent
    from mcp_hostagent.telemetry.otel import Telemetry

    memory, stats = InMemorySpanExporter(), ExportStats()
    t = Telemetry(service_name="mcp-agent", exporters=Exporters(CountingSpanExporter(memory, stats), [], stats),
                  timebase=Timebase(0))
    ms = 1_000_000
    proc = ProcessRegistry.attributes(ProcessInfo(
        pid=4242, start_time_ns=1_700_000_000_000_000_000, comm="vllm", exe_name="vllm",
        command_line="vllm serve", owner="svc", cgroup_path=CGROUP, container_id=CONTAINER, pod_uid=POD_UID,
        container_runtime="containerd"))
    try:
        # a cgroup's storm and a host storm, open (as Reclaim._open does) while the request runs
        psi = {"psi_some_avg10": 12.0, "psi_full_avg10": 3.0}
        storms = [Episode(scope=CGROUP, start_ns=100 * ms, windows=3, peak_kswapd_ratio=0.5, peak_direct_ms_per_s=20,
                          peak_memcg_ms_per_s=300, totals={k: 1 for k in (*memstat.VMSTAT_KEYS, "allocstall")},
                          peaks=psi, hot=[(100 * ms, 300 * ms)]),
                  Episode(scope="host", start_ns=100 * ms, windows=2, peak_kswapd_ratio=0.9, totals={"pgscan_kswapd": 5},
                          peaks=psi, hot=[(100 * ms, 300 * ms)])]
        for n, ep in enumerate(storms):
            t.open(("storm", n), reclaim_t.storm_span(ep))
        # a PCIe link episode on the request's GPU (LinkEpisodeSpans, as Pcie drives it)
        links = pcie_t.LinkEpisodeSpans(t)

        def link_episode(event, t_ns, end_ns=None):
            return LinkEpisode(event=event, episode_id=1, gpu_bdf=GPU_BDF, link_bdf=BRIDGE_BDF,
                               causes=("width_drop", "aer_errors"), from_gen=4, from_width=16, to_gen=4, to_width=8,
                               ref_gen=4, ref_width=16,
                               aer_delta=(("correctable", 3), ("correctable.RxErr", 3), ("nonfatal", 1), ("fatal", 0)),
                               aer_devices=(BRIDGE_BDF,), start_ns=150 * ms, end_ns=end_ns, t_ns=t_ns, busy=True)

        links.on_episode(link_episode("opened", 150 * ms))
        links.on_episode(link_episode("updated", 160 * ms))

        fr = FinishedRequest(
            tgid=4242, tid=4250, request_id=0xABC, comm=b"vllm", cgroup_id=77, begin_ns=120 * ms, end_ns=320 * ms,
            parent=TraceParent(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 1),
            traceparent_state="valid", end_reason="marked",
            counters=Counters(**{f: 150 * ms for f in COUNTER_FIELDS}))

        # the registry's capabilities, made as `run` makes them, their state set as their sources set it;
        # the one request path renders the span (core/request.py RequestPath.span)
        agent = unstarted_agent()
        reclaim, gpu, pcie, nic, cuda = (agent.caps[n] for n in ("reclaim", "gpuhealth", "pcie", "nic", "cuda"))
        reclaim.kswapd_attached = True
        reclaim.kswapd = SimpleNamespace(active_ns=lambda t0, t1, nid=None: 5 * ms)
        reclaim.episodes = list(enumerate(storms))
        reclaim._paths = {fr.tgid: CGROUP}  # the request's memory cgroup
        reclaim.stalls[(fr.tgid, fr.tid, fr.request_id)] = (
            ReclaimStall(Header(0, 4242, 4250, 0, 200 * ms, 77, b"vllm"), "direct", 190 * ms, 32, 0xCC0, 0, 0xABC),)
        reclaim.oom_kills = [(fr.tgid, CGROUP, OomKill(fr.tgid, "vllm", 1 << 20, 0, 0, 0, ts_ns=150 * ms, scope="memcg"))]
        agg = GpuAggregate(index=0, uuid="GPU-8a1c", pci_bus_id=GPU_BDF, samples=4, util_gpu_mean_pct=35.0,
                           util_gpu_max_pct=90, util_mem_mean_pct=20.0, util_mem_max_pct=40,
                           mem_used_max_bytes=60 << 30, sm_clock_min_mhz=900, sm_clock_max_mhz=1980,
                           mem_clock_min_mhz=2600, throttle_reasons=("hw_thermal_slowdown",), power_max_mw=650_000,
                           temperature_max_c=88, pcie_gen_min=4, pcie_width_min=8, pcie_replays=2,
                           process_mem_max_bytes=40 << 30, process_sm_util_mean_pct=30.0)
        gpu.gpus_of = lambda pid: {0: GPU_BDF, 1: "0000:5e:00.0"}
        gpu.sampler = SimpleNamespace(aggregate=lambda g, t0, t1, pid=None: agg)
        gpu.xids = [XidEvent(200 * ms, 0, "GPU-8a1c", GPU_BDF, 79, "bpf", "GPU has fallen off the bus.", 4242)]
        pcie.gpus_of, pcie.links = gpu.gpus_of, links
        pcie.last_pcie = SimpleNamespace(paths={GPU_BDF: (BRIDGE_BDF,)})
        pcie.judge = SimpleNamespace(note_aer_event=lambda *a: None)
        pcie.poller = SimpleNamespace(_clock=lambda: 0)
        pcie.on_aer(AerRecord(BRIDGE_BDF, "nonfatal", 0x20, ("Undefined", "DLP"), 0), 200 * ms)
        pcie.on_link_event(LinkEventRecord(BRIDGE_BDF, "autonomous", 16.0, 16.0, 8, 0, 0x2000, 0), 210 * ms)
        nic.nic_events = [LinkEvent(220 * ms, "eth2", 3, "carrier_down", False, "down", 100_000, 100_000, 2)]
        cuda.probes = SimpleNamespace(  # cuLaunchKernel duty-cycled
            launch_coverage=lambda pid, t0, t1: {"cu_launch": (0.4, 0.6)})
        spec = agent.path.span(fr, proc)
        assert spec.links and spec.events and spec.children, "the harness should produce links, events and a stall"
        assert not agent.health.rejected, agent.health.rejected
        t.span(spec)

        step = GpuStep(Header(0, 4242, 4251, 0, 400 * ms, 77, b"vllm"), 300 * ms, 80 * ms, "stream",
                       Counters(**{f: 3 for f in COUNTER_FIELDS}))
        t.span(cuda_t.step_span(step, proc))

        for n, ep in enumerate(storms):  # closed as Reclaim closes them (the exit path adds "unfinished")
            ep.end_ns, ep.closed = 500 * ms, True
            t.close(("storm", n), {**reclaim_t.episode_attributes(ep), "hostagent.storm.unfinished": n == 1}, ep.end_ns)
        links.on_episode(link_episode("closed", 600 * ms, end_ns=600 * ms))
        t.tracer_provider.force_flush(5000)
        spans = memory.get_finished_spans()
    finally:
        t.shutdown()

    out = {"names": set(), "span": {}, "resource": {}, "events": {}, "link": set()}
    for s in spans:
        out["names"].add(s.name)
        out["span"].setdefault(s.name, set()).update(s.attributes or {})
        out["resource"].setdefault(s.name, set()).update(s.resource.attributes)
        for e in s.events:
            out["events"].setdefault(e.name, set()).update(e.attributes or {})
        for ln in s.links:
            out["link"].update(ln.attributes or {})
    return out


def test_the_harness_exports_every_span_kind(exported):
    assert exported["names"] == {"hostagent.request", "hostagent.reclaim.stall", "hostagent.gpu_step",
                                 "hostagent.reclaim_storm", "hostagent.pcie.link_episode"}
    # the process's identity is the resource of request and step spans, not a span attribute
    for name in ("hostagent.request", "hostagent.gpu_step"):
        assert {"process.executable.name", "process.pid", "process.command_line", "container.id",
                "k8s.pod.uid", "service.name", "host.name"} <= exported["resource"][name]
        assert {"process.pid", "thread.id"} <= exported["span"][name]
        assert "process.executable.name" not in exported["span"][name]
    assert "process.pid" not in exported["resource"]["hostagent.reclaim_storm"]
    assert {"hostagent.reclaim_storm", "hostagent.pcie.link_episode", "hostagent.gpu.xid", "hostagent.nic.link_event",
            "hostagent.pcie.aer_event", "hostagent.pcie.link_event", "hostagent.pcie.link_update"} <= set(exported["events"])


# ---- the code's dynamic names and event literals -------------------------------------------------------

def dynamic_span_attribute(name: str) -> bool:
    """Attributes whose names the code builds: checked by prefix and against the code's own lists."""
    from mcp_hostagent.cuda.steps import FINDING_SHARES
    from mcp_hostagent.gpuhealth.nvml import GpuAggregate
    from mcp_hostagent.pcie.sysfs import AER_FILES
    from mcp_hostagent.reclaim import memstat

    gpu_keys = set(GpuAggregate(0, None, None, 1, 1.0, 1, 1.0, 1, 1, 1, 1, 1, ("x",), 1, 1, 1, 1, 1, 1, 1.0)
                   .attributes("P"))
    m = re.fullmatch(r"hostagent\.gpu\.\d+\.(.+)", name)
    if m:
        return f"P.{m.group(1)}" in gpu_keys
    m = re.fullmatch(r"hostagent\.storm\.(?:peak\.)?(.+)", name)
    if m:
        return m.group(1) in {*memstat.VMSTAT_KEYS, "allocstall", "psi_some_avg10", "psi_full_avg10"}
    m = re.fullmatch(r"hostagent\.finding\.(.+)", name)
    if m:
        return m.group(1) in FINDING_SHARES
    m = re.fullmatch(r"hostagent\.pcie\.aer\.([a-z]+)(?:\.[A-Za-z0-9_]+)?", name)
    if m:
        return m.group(1) in {kind for kind, _ in AER_FILES}
    return False


def code_events() -> dict[str, set[str]]:
    """Event names the code names, with the attribute keys it gives them where they are literal:
    EventSpec("name", t, {...}), telemetry.event(key, "name", t, {...}), and the capabilities' kept
    (name, t, ..., {...}) tuples."""
    out: dict[str, set[str]] = {}

    def keys(node) -> set[str]:
        return {k.value for k in getattr(node, "keys", []) if isinstance(k, ast.Constant) and isinstance(k.value, str)}

    for path in AGENT_SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name, attrs = None, None
            if isinstance(node, ast.Call):
                f = node.func
                fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                if fname == "EventSpec" and node.args and isinstance(node.args[0], ast.Constant):
                    name, attrs = node.args[0].value, node.args[2] if len(node.args) > 2 else None
                elif fname == "event" and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                    name, attrs = node.args[1].value, node.args[3] if len(node.args) > 3 else None
            elif (isinstance(node, ast.Tuple) and len(node.elts) >= 3 and isinstance(node.elts[0], ast.Constant)
                  and isinstance(node.elts[0].value, str) and node.elts[0].value.startswith("hostagent.")
                  and not isinstance(node.elts[1], ast.Constant)):
                name, attrs = node.elts[0].value, node.elts[-1]
            if isinstance(name, str):
                out.setdefault(name, set()).update(keys(attrs) if isinstance(attrs, ast.Dict) else set())
    return out


# ---- the queries -------------------------------------------------------------------------------------

_SCOPED = re.compile(r"(?<![\w.:])(span|resource|event|link)\.([A-Za-z0-9_][A-Za-z0-9_.\-]*[A-Za-z0-9_])")
_UNSCOPED = re.compile(r"(?<![\w.:\"])\.([A-Za-z_][A-Za-z0-9_.]*[A-Za-z0-9_])")
_SPAN_NAME = re.compile(r"(?<![\w:.])(?:span:)?name\s*(=|!=|=~)\s*\"([^\"]*)\"")
_EVENT_NAME = re.compile(r"event:name\s*(=|!=|=~)\s*\"([^\"]*)\"")


def doc_queries() -> list[str]:
    """Every line of every ```traceql block: one query a line."""
    text = DOC.read_text()
    blocks = re.findall(r"```traceql\n(.*?)```", text, re.S)
    return [q.strip() for b in blocks for q in b.splitlines() if q.strip()]


def rule_queries() -> list[str]:
    """The `traceql:` annotations of rules.yml, Go templates replaced by a plain value."""
    text = RULES.read_text()
    out = []
    for m in re.finditer(r"^ +traceql: >-\n((?: {12}.*\n?)+)", text, re.M):
        q = " ".join(line.strip() for line in m.group(1).splitlines())
        out.append(re.sub(r"\{\{.*?\}\}(?:\{\{.*?\}\})*", "x", q))
    return out


def dashboard_queries() -> list[str]:
    d = json.loads(DASHBOARD.read_text())
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                if t.get("queryType") == "traceql":
                    out.append(re.sub(r"\$\{[^}]*\}|\$\w+", "x", t["query"]))
            walk(p.get("panels", []))
    walk(d["panels"])
    return out


def balanced(q: str) -> str | None:
    """None, or why the query's braces/parentheses/quotes do not balance (outside strings)."""
    stack, i = [], 0
    pairs = {"}": "{", ")": "(", "]": "["}
    while i < len(q):
        c = q[i]
        if c == '"':
            j = i + 1
            while j < len(q) and q[j] != '"':
                j += 2 if q[j] == "\\" else 1
            if j >= len(q):
                return f"unterminated string at {i}"
            i = j + 1
            continue
        if c in "{([":
            stack.append(c)
        elif c in "})]":
            if not stack or stack.pop() != pairs[c]:
                return f"unbalanced {c!r} at {i}"
        i += 1
    return f"unclosed {stack}" if stack else None


def problems(queries: list[str], exported) -> list[str]:
    span_attrs = set().union(*exported["span"].values())
    resource_attrs = set().union(*exported["resource"].values())
    events = {n: set(a) for n, a in exported["events"].items()}
    for n, a in code_events().items():
        events.setdefault(n, set()).update(a)
    event_attrs = set().union(*events.values())
    out = []
    for q in queries:
        why = balanced(q)
        if why:
            out.append(f"{q}: {why}")
        if not q.startswith("{"):
            out.append(f"{q}: does not start with a spanset filter")
        for m in _SPAN_NAME.finditer(q):
            if m.group(2) not in exported["names"]:
                out.append(f"{q}: no span {m.group(2)!r}")
        for m in _EVENT_NAME.finditer(q):
            if m.group(2) not in events:
                out.append(f"{q}: no event {m.group(2)!r}")
        for scope, attr in _SCOPED.findall(q):
            ok = {"span": attr in span_attrs or dynamic_span_attribute(attr),
                  "resource": attr in resource_attrs,
                  "event": attr in event_attrs,
                  "link": attr in exported["link"]}[scope]
            if not ok:
                out.append(f"{q}: no {scope} attribute {attr!r}")
        for attr in _UNSCOPED.findall(q):
            if not (attr in span_attrs or attr in resource_attrs or dynamic_span_attribute(attr)):
                out.append(f"{q}: no attribute {attr!r}")
    return out


def test_the_checker_catches_wrong_names_scopes_and_balance(exported):
    bad = ['{ name = "hostagent.requests" }',  # no such span
           '{ span.process.executable.name = "vllm" }',  # on the resource, not the span
           '{ resource.hostagent.offcpu.time > 1 }',  # on the span, not the resource
           '{ event:name = "hostagent.storm" }',
           '{ span.hostagent.gpu.7.utilization.avg > 0 }',
           '{ span.hostagent.finding.cuda.sync_heavy > 0 }',
           '{ link.hostagent.storm.trace_id = "x" }',
           '{ name = "hostagent.request" && (span.hostagent.offcpu.time > 1 }',
           '{ name = "hostagent.request }']
    for q in bad:
        assert problems([q], exported), q
    good = ['{ name = "hostagent.request" && span.hostagent.gpu.7.utilization.mean > 0 && '
            'span.hostagent.finding.cuda.sync_bound > 0 && resource.process.executable.name = "vllm" }',
            '{ name = "hostagent.reclaim_storm" && span.hostagent.storm.pgscan_kswapd > 0 && '
            'span.hostagent.storm.peak.psi_full_avg10 > 0 }',
            '{ event.hostagent.storm.scope = "host" && link.hostagent.link.type = "reclaim_storm" }']
    assert problems(good, exported) == []


def test_cookbook_queries_use_real_names(exported):
    queries = doc_queries()
    assert len(queries) >= 40
    assert problems(queries, exported) == []


def test_cookbook_prose_names_are_real(exported):
    """Attributes and names mentioned outside the query blocks too (tables, explanations)."""
    text = re.sub(r"```traceql\n.*?```", "", DOC.read_text(), flags=re.S)
    mentioned = [f"{{ {scope}.{attr} }}" for scope, attr in _SCOPED.findall(text)]
    assert mentioned
    assert problems(mentioned, exported) == []
    every = (exported["names"] | set(exported["events"]) | set(code_events()) | exported["link"]
             | set().union(*exported["span"].values(), *exported["events"].values(), *code_events().values()))
    for name in re.findall(r"`(hostagent\.[a-zA-Z_.]+)", text):
        if name.endswith("."):  # a namespace: `hostagent.gpu.*`, `hostagent.gpu.<index>.*`
            assert any(n.startswith(name) for n in every), name
        else:
            assert name in every or dynamic_span_attribute(name), name


def test_cookbook_covers_what_was_asked(exported):
    text = "\n".join(doc_queries())
    for needle in ('span.hostagent.reclaim.direct.stall.time', 'resource.process.executable.name',
                   'resource.k8s.pod.uid', 'event:name = "hostagent.reclaim_storm"', 'span.hostagent.gpu.throttle_reasons',
                   'name = "hostagent.pcie.link_episode"', 'span.hostagent.context_switches.involuntary',
                   'span.hostagent.finding.cuda.sync_bound', '} > {', '| count() > 3', '| avg(duration)', 'select(',
                   'quantile_over_time'):
        assert needle in text, needle
    # every span the agent exports has a recipe
    for name in exported["names"]:
        assert f'name = "{name}"' in text, name


def test_rule_annotations_and_dashboard_tempo_panels_use_real_names(exported):
    rules, dash = rule_queries(), dashboard_queries()
    assert len(rules) >= 8 and len(dash) >= 3
    assert problems(rules + dash, exported) == []
