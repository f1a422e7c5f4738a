"""agent/requests/telemetry.py: finished requests -> the request span spec, its stall children, the
duration histogram row (docs/TELEMETRY.md); and the joiner counting its refusals into the Counter it is
given (agent/requests/capability.py hands it health.rejected)."""

from __future__ import annotations

from collections import Counter

import pytest

from mcp_hostagent.core.capability import NONE, Evidence
from mcp_hostagent.core.decode import COUNTER_FIELDS, Counters, Header
from mcp_hostagent.core.health import AgentHealth
from mcp_hostagent.reclaim.records import ReclaimStall
from mcp_hostagent.requests import telemetry as T
from mcp_hostagent.requests.join import FinishedRequest, RequestJoiner
from mcp_hostagent.requests.traceparent import TraceParent
from mcp_hostagent.telemetry.spec import EventSpec, LinkSpec, SpanSpec

PARENT = TraceParent(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 1)
PROC = {"process.executable.name": "srv", "process.owner": "alice"}

# every counter field's attribute, as docs/TELEMETRY.md names them
DOC_NAMES = {
    "faults": "mcp.faults.user",
    "vcsw": "mcp.ctx_switches.voluntary",
    "ivcsw": "mcp.ctx_switches.involuntary",
    "offcpu_ns": "mcp.offcpu_ns",
    "direct_reclaims": "mcp.reclaim.direct.count",
    "direct_reclaim_ns": "mcp.reclaim.direct.stall_ns",
    "memcg_reclaims": "mcp.reclaim.memcg.count",
    "memcg_reclaim_ns": "mcp.reclaim.memcg.stall_ns",
    "reclaimed_pages": "mcp.reclaim.pages",
    "kswapd_wakeups": "mcp.reclaim.kswapd_wakeups",
    "cu_launch": "mcp.cuda.launches.cuLaunchKernel",
    "cu_launch_ptsz": "mcp.cuda.launches.cuLaunchKernel_ptsz",
    "cu_launch_ex": "mcp.cuda.launches.cuLaunchKernelEx",
    "cu_launch_ex_ptsz": "mcp.cuda.launches.cuLaunchKernelEx_ptsz",
    "cu_graph_launch": "mcp.cuda.graph_launches",
    "cu_ctx_ops": "mcp.cuda.ctx.count",
    "cu_ctx_ns": "mcp.cuda.ctx.ns",
    "cu_syncs": "mcp.cuda.sync.count",
    "cu_sync_ns": "mcp.cuda.sync.wait_ns",
    "cu_allocs": "mcp.cuda.alloc.count",
    "cu_alloc_ns": "mcp.cuda.alloc.ns",
    "cu_frees": "mcp.cuda.free.count",
    "cu_free_ns": "mcp.cuda.free.ns",
    "nv_ioctls": "mcp.nvidia.ioctl.count",
    "nv_ioctl_ns": "mcp.nvidia.ioctl.ns",
    "sampled": "mcp.cuda.sampled",
}
FOUR = {"mcp.faults.user": 0, "mcp.ctx_switches.voluntary": 0, "mcp.ctx_switches.involuntary": 0, "mcp.offcpu_ns": 0}


def hdr(tid=11, ts_ns=0, tgid=10) -> Header:
    return Header(type=0, tgid=tgid, tid=tid, cpu=0, ts_ns=ts_ns, cgroup_id=77, comm=b"srv")


def stall(begin_ns, end_ns, kind="direct", pages=32, gfp=0xCC0, order=0, tid=11, request_id=0xABC) -> ReclaimStall:
    return ReclaimStall(hdr(tid, end_ns), kind, begin_ns, pages, gfp, order, request_id)


def finished(counters=Counters(), end_reason="marked", stalls=(), parent=PARENT, state="valid",
             begin_ns=1_000_000, end_ns=3_500_000, request_id=0xABC) -> FinishedRequest:
    return FinishedRequest(tgid=10, tid=11, request_id=request_id, comm=b"srv", cgroup_id=4242,
                           begin_ns=begin_ns, end_ns=end_ns, parent=parent, traceparent_state=state,
                           end_reason=end_reason, counters=counters, stalls=stalls)


BASE = {"process.executable.name": "srv", "process.owner": "alice", "process.pid": 10, "thread.id": 11,
        "mcp.request.id": "0000000000000abc", "mcp.request.end_reason": "marked",
        "mcp.request.traceparent": "valid", "mcp.cgroup.id": 4242}


# ---- request_attributes ----

def test_counter_attributes_cover_every_counter_field_by_its_documented_name():
    assert T.COUNTER_ATTRS == DOC_NAMES
    assert set(T.COUNTER_ATTRS) == set(COUNTER_FIELDS)
    assert T.ALWAYS_SHOWN == {"faults", "vcsw", "ivcsw", "offcpu_ns"}


@pytest.mark.parametrize("counters,shown", [
    # nothing counted: the foundation's four, zeros included; nothing else
    (Counters(), FOUR),
    (Counters(faults=3, vcsw=1, ivcsw=2, offcpu_ns=300), {"mcp.faults.user": 3, "mcp.ctx_switches.voluntary": 1,
                                                           "mcp.ctx_switches.involuntary": 2, "mcp.offcpu_ns": 300}),
    # reclaim and CUDA fields only when non-zero
    (Counters(direct_reclaims=2, direct_reclaim_ns=5_000_000, reclaimed_pages=64),
     {**FOUR, "mcp.reclaim.direct.count": 2, "mcp.reclaim.direct.stall_ns": 5_000_000, "mcp.reclaim.pages": 64}),
    (Counters(faults=1, cu_launch_ex=800, cu_syncs=1, cu_sync_ns=700, sampled=1),
     {**FOUR, "mcp.faults.user": 1, "mcp.cuda.launches.cuLaunchKernelEx": 800, "mcp.cuda.sync.count": 1,
      "mcp.cuda.sync.wait_ns": 700, "mcp.cuda.sampled": 1}),
    (Counters(memcg_reclaims=1, memcg_reclaim_ns=9, kswapd_wakeups=4, nv_ioctls=6, nv_ioctl_ns=60),
     {**FOUR, "mcp.reclaim.memcg.count": 1, "mcp.reclaim.memcg.stall_ns": 9, "mcp.reclaim.kswapd_wakeups": 4,
      "mcp.nvidia.ioctl.count": 6, "mcp.nvidia.ioctl.ns": 60}),
])
def test_request_attributes_counters_shown_when_non_zero_but_the_four(counters, shown):
    assert T.request_attributes(finished(counters), PROC) == {**BASE, **shown}


@pytest.mark.parametrize("field", COUNTER_FIELDS)
def test_request_attributes_each_counter_alone(field):
    got = T.request_attributes(finished(Counters(**{field: 7})), {})
    counters = {k: v for k, v in got.items() if k.startswith("mcp.") and k not in
                ("mcp.request.id", "mcp.request.end_reason", "mcp.request.traceparent", "mcp.cgroup.id")}
    assert counters == {**FOUR, DOC_NAMES[field]: 7}


def test_request_attributes_request_fields_win_over_process_attributes():
    fr = finished(end_reason="expired", parent=None, state="begin_lost", request_id=0xFFFF_FFFF_FFFF_FFFF)
    got = T.request_attributes(fr, {"process.pid": 999, "thread.id": 998, "container.id": "c1"})
    assert got == {"process.pid": 10, "thread.id": 11, "container.id": "c1",
                   "mcp.request.id": "ffffffffffffffff", "mcp.request.end_reason": "expired",
                   "mcp.request.traceparent": "begin_lost", "mcp.cgroup.id": 4242, **FOUR}


def test_request_attributes_copies_the_process_attributes():
    proc = dict(PROC)
    T.request_attributes(finished(), proc)
    assert proc == PROC


# ---- stall_span ----

@pytest.mark.parametrize("st,expected", [
    (stall(2_000_000, 2_600_000), SpanSpec("mcp.reclaim.stall", 2_000_000, 2_600_000, {
        "thread.id": 11, "mcp.reclaim.kind": "direct", "mcp.reclaim.pages": 32, "mcp.reclaim.order": 0,
        "mcp.reclaim.gfp_flags": "0xcc0", "mcp.reclaim.stall_ns": 600_000})),
    (stall(10, 12_000_010, kind="memcg", pages=0, gfp=0x100CCA, order=3, tid=12),
     SpanSpec("mcp.reclaim.stall", 10, 12_000_010, {
         "thread.id": 12, "mcp.reclaim.kind": "memcg", "mcp.reclaim.pages": 0, "mcp.reclaim.order": 3,
         "mcp.reclaim.gfp_flags": "0x100cca", "mcp.reclaim.stall_ns": 12_000_000})),
    (stall(5, 5, gfp=0), SpanSpec("mcp.reclaim.stall", 5, 5, {
        "thread.id": 11, "mcp.reclaim.kind": "direct", "mcp.reclaim.pages": 32, "mcp.reclaim.order": 0,
        "mcp.reclaim.gfp_flags": "0x0", "mcp.reclaim.stall_ns": 0})),
])
def test_stall_span(st, expected):
    assert T.stall_span(st) == expected


# ---- request_span ----

LINK = LinkSpec(("storm", 1), {"mcp.link.type": "reclaim_storm", "mcp.storm.scope": "host"},
                EventSpec("mcp.reclaim_storm", 1_500_000, {"mcp.storm.scope": "host"}))
EVENT = EventSpec("mcp.gpu.xid", 2_000_000, {"mcp.gpu.xid": 79})


def test_request_span_carries_the_evidence_and_the_stalls():
    s1, s2 = stall(1_200_000, 1_300_000), stall(2_000_000, 2_500_000, kind="memcg")
    fr = finished(Counters(direct_reclaims=1, direct_reclaim_ns=100_000), stalls=(s1, s2))
    ev = Evidence({"mcp.reclaim.kswapd_overlap_ns": 200, "mcp.finding.cuda.sync_bound": 0.8}, (LINK,), (EVENT,))
    got = T.request_span(fr, PROC, ev)
    assert got == SpanSpec(
        "mcp.request", 1_000_000, 3_500_000,
        {**BASE, **FOUR, "mcp.reclaim.direct.count": 1, "mcp.reclaim.direct.stall_ns": 100_000,
         "mcp.reclaim.kswapd_overlap_ns": 200, "mcp.finding.cuda.sync_bound": 0.8},
        parent=PARENT, links=(LINK,), events=(EVENT,), children=(T.stall_span(s1), T.stall_span(s2)), error=None)
    assert [c.start_ns for c in got.children] == [1_200_000, 2_000_000]  # in order


def test_request_span_without_evidence_or_stalls():
    got = T.request_span(finished(parent=None, state="missing"), {}, NONE)
    assert got == SpanSpec("mcp.request", 1_000_000, 3_500_000, {
        "process.pid": 10, "thread.id": 11, "mcp.request.id": "0000000000000abc",
        "mcp.request.end_reason": "marked", "mcp.request.traceparent": "missing", "mcp.cgroup.id": 4242, **FOUR})
    assert (got.parent, got.links, got.events, got.children, got.error) == (None, (), (), (), None)


def test_request_span_evidence_attributes_win():
    ev = Evidence({"mcp.cgroup.id": 1, "mcp.gpu.index": 0})
    attrs = T.request_span(finished(), PROC, ev).attributes
    assert (attrs["mcp.cgroup.id"], attrs["mcp.gpu.index"]) == (1, 0)


@pytest.mark.parametrize("reason,error", [
    ("marked", None),
    ("superseded", "request ended: superseded"),
    ("thread_exit", "request ended: thread_exit"),
    ("process_exit", "request ended: process_exit"),
    ("expired", "request ended: expired"),
    ("id_mismatch", "request ended: id_mismatch"),
])
def test_request_span_error_only_for_error_end_reasons(reason, error):
    got = T.request_span(finished(end_reason=reason), PROC, NONE)
    assert got.error == error
    assert got.attributes["mcp.request.end_reason"] == reason


# ---- duration_row ----

@pytest.mark.parametrize("fr,proc,row", [
    (finished(), PROC, (2.5, {"process.executable.name": "srv", "mcp.request.end_reason": "marked"})),
    (finished(end_reason="expired", begin_ns=0, end_ns=30_000_000_000), {},
     (30_000.0, {"process.executable.name": "", "mcp.request.end_reason": "expired"})),
    (finished(begin_ns=7, end_ns=7), {"process.executable.name": "py", "process.pid": 3},
     (0.0, {"process.executable.name": "py", "mcp.request.end_reason": "marked"})),
    (finished(begin_ns=1_000, end_ns=1_500), PROC,
     (0.0005, {"process.executable.name": "srv", "mcp.request.end_reason": "marked"})),
])
def test_duration_row(fr, proc, row):
    assert T.duration_row(fr, proc) == row


# ---- the joiner's refusals land in the Counter it is given ----

def _rid_end(rid, reason="marked", tid=11, ts=5_000):
    from mcp_hostagent.requests.records import ReqEnd

    return ReqEnd(hdr(tid, ts), rid, 1_000, reason, Counters())


def test_joiner_counts_into_the_given_counter():
    from mcp_hostagent.requests.records import ReqBegin

    rejected = Counter()  # empty, so falsy: the joiner must keep it, not make its own
    j = RequestJoiner(rejected)
    assert j.rejected is rejected
    j.on_end(_rid_end(9))  # no BEGIN: begin_lost
    j.on_begin(ReqBegin(hdr(12, 100), 5, b"garbage"))
    j.on_end(_rid_end(5, tid=12))  # bad traceparent
    j.on_begin(ReqBegin(hdr(13, 100), 6, b""))
    j.on_begin(ReqBegin(hdr(13, 200), 7, b""))  # the first's END lost
    assert rejected == Counter({"begin_lost": 1, "bad_traceparent": 1, "end_lost": 1})


def test_joiner_adds_to_the_health_counter_as_the_capability_wires_it():
    health = AgentHealth()
    health.rejected["decode_short"] = 2
    j = RequestJoiner(health.rejected)
    j.on_end(_rid_end(9))
    j.on_end(_rid_end(10))
    assert health.rejected == Counter({"decode_short": 2, "begin_lost": 2})
    assert health.all_rejected()["begin_lost"] == 2


def test_joiner_without_a_counter_keeps_its_own():
    a, b = RequestJoiner(), RequestJoiner()
    a.on_end(_rid_end(9))
    assert (a.rejected, b.rejected) == (Counter({"begin_lost": 1}), Counter())
