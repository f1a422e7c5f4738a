"""core/request.py, with the registry's own capabilities (made, not started: no BPF needed): a finished
request -> its span spec (each capability's counters under the names docs/TELEMETRY.md gives, kernel
ns as seconds, the process's identity as its resource, reclaim's stalls as children), the duration
row; and the rule that makes merge order irrelevant: one writer per attribute, declared, checked when
the agent is made, an undeclared write dropped and counted."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from mcp_hostagent.config import load_config
from mcp_hostagent.core import request as RQ
from mcp_hostagent.core.capability import Capability, Declaration, Evidence
from mcp_hostagent.core.decode import COUNTER_FIELDS, Counters, Header
from mcp_hostagent.core.health import AgentHealth
from mcp_hostagent.core.request import FinishedRequest, Owners
from mcp_hostagent.core.traceparent import TraceParent
from mcp_hostagent.reclaim.records import ReclaimStall
from mcp_hostagent.registry import CAPABILITIES, make_agent
from mcp_hostagent.requests.join import RequestJoiner
from mcp_hostagent.telemetry.spec import SpanSpec

TELEMETRY_MD = Path(__file__).resolve().parents[2] / "docs" / "TELEMETRY.md"
PARENT = TraceParent(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 1)
PROC = {"process.pid": 10, "process.executable.name": "srv", "process.owner": "alice",
        "process.command_line": "srv --port 80", "container.id": "c1"}
FOUR = {"hostagent.faults.user": 0, "hostagent.context_switches.voluntary": 0,
        "hostagent.context_switches.involuntary": 0, "hostagent.offcpu.time": 0.0}
BASE = {"process.pid": 10, "thread.id": 11, "hostagent.request.id": "0000000000000abc",
        "hostagent.request.end_reason": "marked", "hostagent.request.traceparent": "valid",
        "hostagent.cgroup.id": 4242, "hostagent.request.source": "marker"}


@pytest.fixture(scope="module")
def agent():
    return make_agent(load_config(None, env={}), nvml_module=object())


def hdr(tid=11, ts_ns=0, tgid=10) -> Header:
    return Header(type=0, tgid=tgid, tid=tid, cpu=0, ts_ns=ts_ns, cgroup_id=77, comm=b"srv")


def stall(begin_ns, end_ns, kind="direct", tid=11, request_id=0xABC) -> ReclaimStall:
    return ReclaimStall(hdr(tid, end_ns), kind, begin_ns, 32, 0xCC0, 0, request_id)


def finished(counters=Counters(), end_reason="marked", parent=PARENT, state="valid", begin_ns=1_000_000,
             end_ns=3_500_000, request_id=0xABC, **kw) -> FinishedRequest:
    return FinishedRequest(tgid=10, tid=11, request_id=request_id, comm=b"srv", cgroup_id=4242, begin_ns=begin_ns,
                           end_ns=end_ns, parent=parent, traceparent_state=state, end_reason=end_reason,
                           counters=counters, **kw)


# ---- the names: each capability's, as docs/TELEMETRY.md documents them ----

def documented_request_attributes() -> list[re.Pattern]:
    """The attribute names of TELEMETRY.md's `hostagent.request` section, as patterns: `<symbol>`-style
    placeholders match a name's part, and a cell's shorthand (`.involuntary` after
    `hostagent.context_switches.voluntary`) is read against each prefix of the full name before it."""
    text = TELEMETRY_MD.read_text()
    section = text[text.index("## Span `hostagent.request`"):]
    section = section[:section.index("\n## ", 5)]
    out = []
    for line in section.splitlines():
        cell = line.split("|")[1] if line.startswith("| `") else line  # a table's name column, or prose
        parts: list[str] = []
        for n in re.findall(r"`([^` =]+)`", cell):
            if "." not in n:
                continue
            if not n.startswith("."):
                parts = n.split(".")  # the shorthand after it is read against its prefixes
            cands = [n] if not n.startswith(".") else [".".join(parts[:i]) + n for i in range(1, len(parts))]
            for c in cands:
                out.append(re.compile(re.sub(r"<[a-z]+>", r"[A-Za-z0-9_.]+", re.escape(c).replace(r"\<", "<")
                                             .replace(r"\>", ">")) + "$"))
    return out


def test_every_request_attribute_a_capability_declares_is_documented():
    docs = documented_request_attributes()
    declared = list(RQ.OWN_ATTRIBUTES)
    for d in CAPABILITIES:
        declared += [n for n in d.attributes if not n.endswith(".*")] + list(d.counters.values())
    undocumented = [n for n in declared if not any(p.match(n) for p in docs)]
    assert not undocumented, f"declared but not in docs/TELEMETRY.md's hostagent.request section: {undocumented}"
    for d in CAPABILITIES:  # a family: some documented name is in it
        for fam in (n[:-1] for n in d.attributes if n.endswith(".*")):
            assert any(p.pattern.startswith(re.escape(fam)) for p in docs), fam


def test_every_counter_field_is_one_capabilitys():
    """Each struct mcp_counters field is rendered by the capability whose probes count it, once; the
    two NUMA fields become numa's remote share (its evidence), not attributes of their own."""
    owners = Counter(f for d in CAPABILITIES for f in d.counters)
    assert all(n == 1 for n in owners.values()), owners
    assert set(owners) | {"oncpu_homed_ns", "oncpu_remote_ns"} == set(COUNTER_FIELDS)
    for d in CAPABILITIES:  # kernel ns are exported in seconds, and the names say `.time`, never a unit
        for f, name in d.counters.items():
            assert name.endswith(".time") == f.endswith("_ns"), (f, name)
            assert not name.endswith(("_ns", "_ms")), name


# ---- the span ----

@pytest.mark.parametrize("counters,shown", [
    (Counters(), FOUR),  # nothing counted: the foundation's four, zeros included; nothing else
    (Counters(direct_reclaims=2, direct_reclaim_ns=5_000_000, reclaimed_pages=64),
     {**FOUR, "hostagent.reclaim.direct.count": 2, "hostagent.reclaim.direct.stall.time": 0.005,
      "hostagent.reclaim.pages": 64}),
    (Counters(faults=1, cu_launch_ex=800, cu_syncs=1, cu_sync_ns=700, sampled=1),
     {**FOUR, "hostagent.faults.user": 1, "hostagent.cuda.launches.cuLaunchKernelEx": 800,
      "hostagent.cuda.sync.count": 1, "hostagent.cuda.sync.time": 7e-7, "hostagent.cuda.sampled": 1}),
    (Counters(oncpu_ns=4_000_000_000, oncpu_homed_ns=2_000_000_000, oncpu_remote_ns=500_000_000),
     {**FOUR, "hostagent.oncpu.time": 4.0, "hostagent.numa.remote.time": 0.5, "hostagent.numa.remote.ratio": 0.25}),
])
def test_counters_shown_when_not_zero_but_the_four(agent, counters, shown):
    got = agent.path.span(finished(counters), PROC)
    assert {k: v for k, v in got.attributes.items() if not k.startswith("hostagent.reclaim.kswapd.overlap")} == {**BASE, **shown}
    assert got.resource == PROC and got.parent == PARENT and got.error is None


def test_each_counter_alone_appears_under_its_capabilitys_name(agent):
    for d in CAPABILITIES:
        for f, name in d.counters.items():
            got = agent.path.span(finished(Counters(**{f: 7})), PROC).attributes
            assert got[name] == (7e-9 if f.endswith("_ns") else 7), (d.name, f)


def test_zero_code_scopes_get_each_counters_name_scoped(agent):
    fr = finished(scopes=(("process", Counters(faults=5, cu_syncs=2, oncpu_ns=10, oncpu_homed_ns=10)),),
                  attributes={"hostagent.request.process.concurrency": 3}, source="http", http_status=200)
    got = agent.path.span(fr, PROC).attributes
    assert got["hostagent.request.source"] == "http"
    assert (got["hostagent.request.process.faults.user"], got["hostagent.request.process.cuda.sync.count"],
            got["hostagent.request.process.numa.remote.ratio"], got["hostagent.request.process.concurrency"]) == (5, 2, 0.0, 3)


def test_stalls_are_reclaims_children_of_their_own_request_only(agent):
    reclaim = agent.caps["reclaim"]
    reclaim.on_stall(stall(1_200_000, 1_300_000))
    reclaim.on_stall(stall(2_000_000, 2_500_000, kind="memcg"))
    reclaim.on_stall(stall(2_000_000, 2_100_000, request_id=0xDEF))  # another request of the thread
    reclaim.on_stall(stall(2_000_000, 2_100_000, request_id=0))  # outside any request: no span
    got = agent.path.span(finished(), PROC)
    assert [(c.name, c.start_ns, c.attributes["hostagent.reclaim.kind"]) for c in got.children] == [
        ("hostagent.reclaim.stall", 1_200_000, "direct"), ("hostagent.reclaim.stall", 2_000_000, "memcg")]
    assert agent.path.span(finished(), PROC).children == ()  # taken by their request
    assert len(agent.path.span(finished(request_id=0xDEF), PROC).children) == 1


@pytest.mark.parametrize("reason,error", [
    ("marked", None), ("superseded", "request ended: superseded"), ("thread_exit", "request ended: thread_exit"),
    ("process_exit", "request ended: process_exit"), ("expired", "request ended: expired"),
    ("id_mismatch", "request ended: id_mismatch"),
])
def test_error_only_for_error_end_reasons(agent, reason, error):
    got = agent.path.span(finished(end_reason=reason), PROC)
    assert got.error == error and got.attributes["hostagent.request.end_reason"] == reason


# ---- one writer per attribute ----

def test_two_declared_writers_of_one_attribute_are_refused():
    with pytest.raises(ValueError, match="hostagent.x.y.*both a and b"):
        Owners([("a", ("hostagent.x.y",)), ("b", ("hostagent.x.y",))])
    with pytest.raises(ValueError, match="both a and b|overlap"):
        Owners([("a", ("hostagent.gpu.*",)), ("b", ("hostagent.gpu.pcie.*",))])
    with pytest.raises(ValueError, match="overlap"):
        Owners([("a", ("hostagent.gpu.pcie.*",)), ("b", ("hostagent.gpu.*",))])
    with pytest.raises(ValueError, match="both"):
        Owners([("a", ("hostagent.gpu.*",)), ("b", ("hostagent.gpu.index",))])
    own = Owners([("request", RQ.OWN_ATTRIBUTES)] + [(d.name, tuple(d.attributes) + tuple(d.counters.values()))
                                                     for d in CAPABILITIES])
    assert own.owns("cuda", "hostagent.cuda.launches.cuLaunchKernel")
    assert own.owns("cuda", "hostagent.request.group.cuda.coverage.cuLaunchKernel")  # scoped: its base's owner
    assert own.owns("http", "hostagent.request.group.root_pid") and not own.owns("cuda", "hostagent.faults.user")


class Nosy(Capability):
    """Writes another capability's attribute (requests' faults), and one nobody declared."""

    def evidence(self, fr):
        return Evidence({"hostagent.faults.user": 99, "hostagent.nosy.own": 1, "hostagent.nobody": 2})


NOSY = Declaration(name="nosy", make=lambda: Nosy, attributes=("hostagent.nosy.own",))


def test_an_undeclared_write_is_dropped_and_counted_whatever_the_order():
    from mcp_hostagent.core.agent import Agent

    for caps in ((NOSY, *CAPABILITIES), (*CAPABILITIES, NOSY)):
        ag = Agent(load_config(None, env={}), caps, nvml_module=object())
        got = ag.path.span(finished(Counters(faults=3)), PROC).attributes
        assert got["hostagent.faults.user"] == 3 and got["hostagent.nosy.own"] == 1 and "hostagent.nobody" not in got
        assert ag.health.rejected["evidence_undeclared"] == 2


def test_an_agent_whose_capabilities_declare_one_name_twice_is_not_made():
    from mcp_hostagent.core.agent import Agent

    twin = Declaration(name="twin", make=lambda: Capability, attributes=("hostagent.reclaim.kswapd.overlap.time",))
    with pytest.raises(ValueError, match="both reclaim and twin"):
        Agent(load_config(None, env={}), (*CAPABILITIES, twin), nvml_module=object())


def test_a_needed_input_nobody_provides_is_refused_when_the_agent_is_made():
    from mcp_hostagent.core.agent import Agent

    needy = Declaration(name="needy", make=lambda: Capability, needs=("gpu.nothing",))
    with pytest.raises(ValueError, match="needy needs input 'gpu.nothing'"):
        Agent(load_config(None, env={}), (*CAPABILITIES, needy), nvml_module=object())


# ---- the duration metric ----

SRV = {"process.executable.name": "srv", "process.owner": "alice", "container.id": "c1"}


@pytest.mark.parametrize("fr,proc,row", [
    # seconds; labels bounded: the executable name, who owns it (user, container, pod, where known) and
    # the end reason; nothing per request, process or command line
    (finished(), PROC, (0.0025, {**SRV, "hostagent.request.end_reason": "marked"})),
    (finished(end_reason="expired", begin_ns=0, end_ns=30_000_000_000), {},
     (30.0, {"process.executable.name": "", "hostagent.request.end_reason": "expired"})),
    (finished(), {**PROC, "k8s.pod.uid": "u1", "process.creation.time": "t", "hostagent.cgroup.path": "/x"},
     (0.0025, {**SRV, "k8s.pod.uid": "u1", "hostagent.request.end_reason": "marked"})),
])
def test_duration_row(fr, proc, row):
    assert RQ.duration_row(fr, proc) == row
    assert list(RQ.duration_row(fr, proc)[1])[-1] == "hostagent.request.end_reason"
    assert [(i.name, i.kind, i.unit) for i in RQ.INSTRUMENTS] == [("hostagent.request.duration", "histogram", "s")]


def test_two_users_binaries_of_one_name_never_share_a_series():
    """Another user's `vllm` (or one in another container) is not the real vLLM's latency."""
    real = {"process.pid": 10, "process.executable.name": "vllm", "process.owner": "vllm-svc"}
    rows = {frozenset(RQ.duration_row(finished(), p)[1].items()) for p in (
        real, {**real, "process.pid": 11},  # the same server's second process: the same series
        {**real, "process.pid": 12, "process.owner": "mallory"},
        {**real, "process.pid": 13, "container.id": "c2"},
        {**real, "process.pid": 14, "process.owner": "1001"})}  # a uid without a name
    assert len(rows) == 4


def test_finish_exports_the_span_the_metric_and_tells_the_listeners(agent):
    spans, rows, heard = [], [], []

    class Tel:
        def span(self, spec):
            spans.append(spec)
            return "ctx"

        def record(self, name, v, attrs):
            rows.append((name, v, attrs))

    path = RQ.RequestPath(agent._pairs, agent.processes, Tel(), AgentHealth())
    path.listeners.append(lambda fr, span, ctx: heard.append((span, ctx)))
    path.processes = type("P", (), {"attrs": staticmethod(lambda pid, comm: PROC)})()
    path.finish(finished())
    assert isinstance(spans[0], SpanSpec) and rows[0][0] == "hostagent.request.duration"
    assert heard == [(spans[0], "ctx")] and path.health.requests["marked"] == 1


# ---- the joiner's refusals land in the Counter it is given ----

def _end(rid, tid=11):
    from mcp_hostagent.requests.records import ReqEnd

    return ReqEnd(hdr(tid, 5_000), rid, 1_000, "marked", Counters())


def test_joiner_counts_into_the_given_counter():
    from mcp_hostagent.requests.records import ReqBegin

    rejected = Counter()  # empty, so falsy: the joiner must keep it, not make its own
    j = RequestJoiner(rejected)
    assert j.rejected is rejected
    j.on_end(_end(9))  # no BEGIN: begin_lost
    j.on_begin(ReqBegin(hdr(12, 100), 5, b"garbage"))
    j.on_end(_end(5, tid=12))  # bad traceparent
    j.on_begin(ReqBegin(hdr(13, 100), 6, b""))
    j.on_begin(ReqBegin(hdr(13, 200), 7, b""))  # the first's END lost
    assert rejected == Counter({"begin_lost": 1, "bad_traceparent": 1, "end_lost": 1})
