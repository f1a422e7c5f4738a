"""agent/requests/telemetry.py: finished requests -> the request span spec (the process's identity as
its resource, kernel ns as seconds), its stall children, the duration histogram row (docs/TELEMETRY.md); and the joiner counting its refusals into the Counter it is
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
PROC = {"process.pid": 10, "process.executable.name": "srv", "process.owner": "alice",
        "process.command_line": "srv --port 80", "container.id": "c1"}

# every counter field's attribute, as docs/TELEMETRY.md names them
DOC_NAMES = {
    "faults": "hostagent.faults.user",
    "vcsw": "hostagent.context_switches.voluntary",
    "ivcsw": "hostagent.context_switches.involuntary",
    "offcpu_ns": "hostagent.offcpu.time",
    "direct_reclaims": "hostagent.reclaim.direct.count",
    "direct_reclaim_ns": "hostagent.reclaim.direct.stall.time",
    "memcg_reclaims": "hostagent.reclaim.memcg.count",
    "memcg_reclaim_ns": "hostagent.reclaim.memcg.stall.time",
    "reclaimed_pages": "hostagent.reclaim.pages",
    "kswapd_wakeups": "hostagent.reclaim.kswapd_wakeups",
    "cu_launch": "hostagent.cuda.launches.cuLaunchKernel",
    "cu_launch_ptsz": "hostagent.cuda.launches.cuLaunchKernel_ptsz",
    "cu_launch_ex": "hostagent.cuda.launches.cuLaunchKernelEx",
    "cu_launch_ex_ptsz": "hostagent.cuda.launches.cuLaunchKernelEx_ptsz",
    "cu_graph_launch": "hostagent.cuda.graph_launches",
    "cu_ctx_ops": "hostagent.cuda.ctx.count",
    "cu_ctx_ns": "hostagent.cuda.ctx.time",
    "cu_syncs": "hostagent.cuda.sync.count",
    "cu_sync_ns": "hostagent.cuda.sync.time",
    "cu_allocs": "hostagent.cuda.alloc.count",
    "cu_alloc_ns": "hostagent.cuda.alloc.time",
    "cu_frees": "hostagent.cuda.free.count",
    "cu_free_ns": "hostagent.cuda.free.time",
    "nv_ioctls": "hostagent.nvidia.ioctl.count",
    "nv_ioctl_ns": "hostagent.nvidia.ioctl.time",
    "sampled": "hostagent.cuda.sampled",
    "offcpu_runnable_ns": "hostagent.offcpu.runnable.time",
    "wakeup_wait_ns": "hostagent.offcpu.wakeup_wait.time",
    "wakeups": "hostagent.offcpu.wakeups",
    "cu_alloc_oom": "hostagent.cuda.alloc.out_of_memory",
    "oncpu_ns": "hostagent.oncpu.time",
    "pagecache_added_bytes": "hostagent.page_cache.added.size",
}
# shown through their quotient, and only with a home node (a 0 then is measured): alone, each gives
NUMA_FIELDS = {"oncpu_homed_ns": {"hostagent.numa.remote.time": 0.0, "hostagent.numa.remote.ratio": 0.0},
               "oncpu_remote_ns": {}}
# the fields the kernel counts in ns, exported in seconds (names end in .time, never in a unit)
DOC_TIME_FIELDS = {"offcpu_ns", "direct_reclaim_ns", "memcg_reclaim_ns", "cu_ctx_ns", "cu_sync_ns", "cu_alloc_ns",
                   "cu_free_ns", "nv_ioctl_ns", "offcpu_runnable_ns", "wakeup_wait_ns", "oncpu_ns"}
FOUR = {"hostagent.faults.user": 0, "hostagent.context_switches.voluntary": 0,
        "hostagent.context_switches.involuntary": 0, "hostagent.offcpu.time": 0.0}


def s_(ns: int) -> float:
    """ns as the agent exports it: seconds."""
    return ns / 1e9


def hdr(tid=11, ts_ns=0, tgid=10) -> Header:
    return Header(type=0, tgid=tgid, tid=tid, cpu=0, ts_ns=ts_ns, cgroup_id=77, comm=b"srv")


def stall(begin_ns, end_ns, kind="direct", pages=32, gfp=0xCC0, order=0, tid=11, request_id=0xABC) -> ReclaimStall:
    return ReclaimStall(hdr(tid, end_ns), kind, begin_ns, pages, gfp, order, request_id)


def finished(counters=Counters(), end_reason="marked", stalls=(), parent=PARENT, state="valid",
             begin_ns=1_000_000, end_ns=3_500_000, request_id=0xABC) -> FinishedRequest:
    return FinishedRequest(tgid=10, tid=11, request_id=request_id, comm=b"srv", cgroup_id=4242,
                           begin_ns=begin_ns, end_ns=end_ns, parent=parent, traceparent_state=state,
                           end_reason=end_reason, counters=counters, stalls=stalls)


BASE = {"process.pid": 10, "thread.id": 11,
        "hostagent.request.id": "0000000000000abc", "hostagent.request.end_reason": "marked",
        "hostagent.request.traceparent": "valid", "hostagent.cgroup.id": 4242,
        "hostagent.request.source": "marker"}


# ---- request_attributes ----

def test_counter_attributes_cover_every_counter_field_by_its_documented_name():
    assert T.COUNTER_ATTRS == DOC_NAMES
    assert set(T.COUNTER_ATTRS) | set(NUMA_FIELDS) == set(COUNTER_FIELDS)
    assert T.ALWAYS_SHOWN == {"faults", "vcsw", "ivcsw", "offcpu_ns"}
    assert T.TIME_FIELDS == DOC_TIME_FIELDS
    assert all(DOC_NAMES[f].endswith(".time") for f in DOC_TIME_FIELDS)
    assert not any(n.endswith((".time", "_ns", "_ms")) for f, n in DOC_NAMES.items() if f not in DOC_TIME_FIELDS)


@pytest.mark.parametrize("counters,shown", [
    # nothing counted: the foundation's four, zeros included; nothing else
    (Counters(), FOUR),
    (Counters(faults=3, vcsw=1, ivcsw=2, offcpu_ns=300), {"hostagent.faults.user": 3, "hostagent.context_switches.voluntary": 1,
                                                           "hostagent.context_switches.involuntary": 2,
                                                           "hostagent.offcpu.time": s_(300)}),
    # reclaim and CUDA fields only when non-zero
    (Counters(direct_reclaims=2, direct_reclaim_ns=5_000_000, reclaimed_pages=64),
     {**FOUR, "hostagent.reclaim.direct.count": 2, "hostagent.reclaim.direct.stall.time": 0.005, "hostagent.reclaim.pages": 64}),
    (Counters(faults=1, cu_launch_ex=800, cu_syncs=1, cu_sync_ns=700, sampled=1),
     {**FOUR, "hostagent.faults.user": 1, "hostagent.cuda.launches.cuLaunchKernelEx": 800, "hostagent.cuda.sync.count": 1,
      "hostagent.cuda.sync.time": s_(700), "hostagent.cuda.sampled": 1}),
    (Counters(memcg_reclaims=1, memcg_reclaim_ns=9, kswapd_wakeups=4, nv_ioctls=6, nv_ioctl_ns=60),
     {**FOUR, "hostagent.reclaim.memcg.count": 1, "hostagent.reclaim.memcg.stall.time": s_(9), "hostagent.reclaim.kswapd_wakeups": 4,
      "hostagent.nvidia.ioctl.count": 6, "hostagent.nvidia.ioctl.time": s_(60)}),
])
def test_request_attributes_counters_shown_when_non_zero_but_the_four(counters, shown):
    got = T.request_attributes(finished(counters))
    assert got == {**BASE, **shown}
    assert all(isinstance(v, float) for k, v in got.items() if k.endswith(".time"))


@pytest.mark.parametrize("field", COUNTER_FIELDS)
def test_request_attributes_each_counter_alone(field):
    got = T.request_attributes(finished(Counters(**{field: 7})))
    counters = {k: v for k, v in got.items() if k.startswith("hostagent.") and k not in
                ("hostagent.request.id", "hostagent.request.end_reason", "hostagent.request.traceparent", "hostagent.cgroup.id",
                 "hostagent.request.source")}
    if field in NUMA_FIELDS:
        assert counters == {**FOUR, **NUMA_FIELDS[field]}
    else:
        assert counters == {**FOUR, DOC_NAMES[field]: s_(7) if field in DOC_TIME_FIELDS else 7}
    assert set(got) - set(counters) == set(BASE)


def test_request_attributes_are_the_request_own_and_the_process_identity_is_the_resource():
    # the span keeps process.pid and thread.id from the records; whatever the identity says (a stale
    # pid, even a thread.id) stays on the resource, as the process's attributes gave it
    fr = finished(end_reason="expired", parent=None, state="begin_lost", request_id=0xFFFF_FFFF_FFFF_FFFF)
    assert T.request_attributes(fr) == {
        "process.pid": 10, "thread.id": 11, "hostagent.request.id": "ffffffffffffffff",
        "hostagent.request.end_reason": "expired", "hostagent.request.traceparent": "begin_lost",
        "hostagent.request.source": "marker",
        "hostagent.cgroup.id": 4242, **FOUR}
    proc = {"process.pid": 999, "thread.id": 998, "container.id": "c1", "process.command_line": "a b"}
    got = T.request_span(fr, proc, NONE)
    assert got.attributes == T.request_attributes(fr)
    assert got.resource == {"process.pid": 999, "thread.id": 998, "container.id": "c1", "process.command_line": "a b"}


def test_request_span_leaves_the_process_attributes_unchanged():
    proc = dict(PROC)
    got = T.request_span(finished(), proc, Evidence({"hostagent.gpu.index": 0}))
    assert proc == PROC
    assert got.resource == PROC
    assert not set(got.attributes) & (set(PROC) - {"process.pid"})  # identity only on the resource


# ---- stall_span ----

@pytest.mark.parametrize("st,expected", [
    (stall(2_000_000, 2_600_000), SpanSpec("hostagent.reclaim.stall", 2_000_000, 2_600_000, {
        "thread.id": 11, "hostagent.reclaim.kind": "direct", "hostagent.reclaim.pages": 32, "hostagent.reclaim.order": 0,
        "hostagent.reclaim.gfp_flags": "0xcc0", "hostagent.reclaim.stall.time": 0.0006})),
    (stall(10, 12_000_010, kind="memcg", pages=0, gfp=0x100CCA, order=3, tid=12),
     SpanSpec("hostagent.reclaim.stall", 10, 12_000_010, {
         "thread.id": 12, "hostagent.reclaim.kind": "memcg", "hostagent.reclaim.pages": 0, "hostagent.reclaim.order": 3,
         "hostagent.reclaim.gfp_flags": "0x100cca", "hostagent.reclaim.stall.time": 0.012})),
    (stall(5, 5, gfp=0), SpanSpec("hostagent.reclaim.stall", 5, 5, {
        "thread.id": 11, "hostagent.reclaim.kind": "direct", "hostagent.reclaim.pages": 32, "hostagent.reclaim.order": 0,
        "hostagent.reclaim.gfp_flags": "0x0", "hostagent.reclaim.stall.time": 0.0})),
])
def test_stall_span(st, expected):
    got = T.stall_span(st)
    assert got == expected
    assert isinstance(got.attributes["hostagent.reclaim.stall.time"], float)
    assert got.resource is None  # a child: the request's resource is its trace's


# ---- request_span ----

LINK = LinkSpec(("storm", 1), {"hostagent.link.type": "reclaim_storm", "hostagent.storm.scope": "host"},
                EventSpec("hostagent.reclaim_storm", 1_500_000, {"hostagent.storm.scope": "host"}))
EVENT = EventSpec("hostagent.gpu.xid", 2_000_000, {"hostagent.gpu.xid.code": 79})


def test_request_span_carries_the_evidence_and_the_stalls():
    s1, s2 = stall(1_200_000, 1_300_000), stall(2_000_000, 2_500_000, kind="memcg")
    fr = finished(Counters(direct_reclaims=1, direct_reclaim_ns=100_000), stalls=(s1, s2))
    ev = Evidence({"hostagent.reclaim.kswapd.overlap.time": 0.0002, "hostagent.finding.cuda.sync_bound": 0.8}, (LINK,), (EVENT,))
    got = T.request_span(fr, PROC, ev)
    assert got == SpanSpec(
        "hostagent.request", 1_000_000, 3_500_000,
        {**BASE, **FOUR, "hostagent.reclaim.direct.count": 1, "hostagent.reclaim.direct.stall.time": 0.0001,
         "hostagent.reclaim.kswapd.overlap.time": 0.0002, "hostagent.finding.cuda.sync_bound": 0.8},
        parent=PARENT, links=(LINK,), events=(EVENT,), children=(T.stall_span(s1), T.stall_span(s2)), error=None,
        resource=PROC)
    assert [c.start_ns for c in got.children] == [1_200_000, 2_000_000]  # in order


def test_request_span_without_evidence_or_stalls():
    got = T.request_span(finished(parent=None, state="missing"), {}, NONE)
    assert got == SpanSpec("hostagent.request", 1_000_000, 3_500_000, {
        "process.pid": 10, "thread.id": 11, "hostagent.request.id": "0000000000000abc",
        "hostagent.request.end_reason": "marked", "hostagent.request.traceparent": "missing", "hostagent.cgroup.id": 4242,
        "hostagent.request.source": "marker", **FOUR},
        resource={})
    assert (got.parent, got.links, got.events, got.children, got.error) == (None, (), (), (), None)


def test_request_span_evidence_attributes_win():
    ev = Evidence({"hostagent.cgroup.id": 1, "hostagent.gpu.index": 0})
    attrs = T.request_span(finished(), PROC, ev).attributes
    assert (attrs["hostagent.cgroup.id"], attrs["hostagent.gpu.index"]) == (1, 0)


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
    assert got.attributes["hostagent.request.end_reason"] == reason


# ---- duration_row ----

SRV = {"process.executable.name": "srv", "process.owner": "alice", "container.id": "c1"}


@pytest.mark.parametrize("fr,proc,row", [
    # seconds; labels bounded: the executable name, who owns it (user, container, pod, where known) and
    # the end reason; nothing per request, process or command line
    (finished(), PROC, (0.0025, {**SRV, "hostagent.request.end_reason": "marked"})),
    (finished(end_reason="expired", begin_ns=0, end_ns=30_000_000_000), {},
     (30.0, {"process.executable.name": "", "hostagent.request.end_reason": "expired"})),
    (finished(begin_ns=7, end_ns=7), {"process.executable.name": "py", "process.pid": 3},
     (0.0, {"process.executable.name": "py", "hostagent.request.end_reason": "marked"})),
    (finished(begin_ns=1_000, end_ns=1_500), PROC,
     (5e-7, {**SRV, "hostagent.request.end_reason": "marked"})),
    (finished(), {**PROC, "k8s.pod.uid": "u1", "process.creation.time": "t", "hostagent.cgroup.path": "/x"},
     (0.0025, {**SRV, "k8s.pod.uid": "u1", "hostagent.request.end_reason": "marked"})),
])
def test_duration_row(fr, proc, row):
    assert T.duration_row(fr, proc) == row
    assert list(T.duration_row(fr, proc)[1])[-1] == "hostagent.request.end_reason"
    assert T.DURATION == "hostagent.request.duration"
    assert [(i.name, i.kind, i.unit) for i in T.INSTRUMENTS] == [("hostagent.request.duration", "histogram", "s")]


def test_two_users_binaries_of_one_name_never_share_a_series():
    """Another user's `vllm` (or one in another container) is not the real vLLM's latency."""
    real = {"process.pid": 10, "process.executable.name": "vllm", "process.owner": "vllm-svc"}
    rows = {frozenset(T.duration_row(finished(), p)[1].items()) for p in (
        real, {**real, "process.pid": 11},  # the same server's second process: the same series
        {**real, "process.pid": 12, "process.owner": "mallory"},
        {**real, "process.pid": 13, "container.id": "c2"},
        {**real, "process.pid": 14, "process.owner": "1001"})}  # a uid without a name
    assert len(rows) == 4


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
