"""Table tests for the pure stages: bytes -> records (decode) and records -> finished requests (join)."""

from __future__ import annotations

import ctypes

import pytest

from mcp_hostagent.core import records as R
from mcp_hostagent.requests import records as RQ
from mcp_hostagent.core import decode as D
from mcp_hostagent.core.decode import Counters, DecodeError
from mcp_hostagent.requests import records
from mcp_hostagent.requests.records import ProcExit, ReqBegin, ReqEnd
from mcp_hostagent.requests.join import RequestJoiner



def decode(raw: bytes):
    """The core's table-driven decode with the requests capability's record types."""
    return D.decode(raw, records.DECODERS)[0]


TP = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def hdr(type_, size, tgid=10, tid=11, ts=1000, comm=b"srv"):
    return R.Hdr(type_, size, tgid, tid, 0, ts, 77, comm)


def begin_bytes(rid=5, tp=TP, **kw):
    return bytes(RQ.EvReqBegin(hdr(RQ.C["MCP_EV_REQ_BEGIN"], ctypes.sizeof(RQ.EvReqBegin), **kw), rid, tp))


def end_bytes(rid=5, reason=0, begin_ns=1000, faults=3, **kw):
    kw.setdefault("ts", 5000)
    return bytes(RQ.EvReqEnd(hdr(RQ.C["MCP_EV_REQ_END"], ctypes.sizeof(RQ.EvReqEnd), **kw), rid, begin_ns, reason, 0,
                            R.Counters(faults, 1, 2, 300)))


def test_decode_begin_end_exit():
    b = decode(begin_bytes())
    assert isinstance(b, ReqBegin) and b.request_id == 5 and b.traceparent == TP and b.hdr.comm == b"srv"
    e = decode(end_bytes())
    assert isinstance(e, ReqEnd) and e.reason == "marked" and e.counters == Counters(3, 1, 2, 300)
    x = decode(bytes(RQ.EvProcExit(hdr(RQ.C["MCP_EV_PROC_EXIT"], ctypes.sizeof(RQ.EvProcExit)), R.Counters(9, 0, 0, 0))))
    assert isinstance(x, ProcExit) and x.counters.faults == 9


@pytest.mark.parametrize("raw,reason", [
    (b"", "short"),
    (b"\x01\x00" * 10, "short"),
    (bytes(R.Hdr(99, 48, 1, 1, 0, 0, 0, b"")), "unknown_type"),
    (bytes(R.Hdr(1, 48, 1, 1, 0, 0, 0, b"")), "bad_size"),  # begin type, header-sized record
    (begin_bytes()[:-1], "bad_size"),
    (end_bytes(reason=42), "bad_field"),
])
def test_decode_rejects(raw, reason):
    with pytest.raises(DecodeError) as e:
        decode(raw)
    assert e.value.reason == reason


def test_hostile_comm_survives_decode():
    b = decode(begin_bytes(comm=b"\x1b[2J\xff\xfe"))
    assert b.hdr.comm == b"\x1b[2J\xff\xfe"  # raw; identity.sanitize_text escapes it for display


def test_join_pairs_and_parses_traceparent():
    j = RequestJoiner()
    j.on_begin(decode(begin_bytes()))
    fr = j.on_end(decode(end_bytes()))
    assert fr.traceparent_state == "valid" and fr.parent.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736
    assert (fr.begin_ns, fr.end_ns, fr.counters.faults, fr.is_error) == (1000, 5000, 3, False)
    assert not j.open


@pytest.mark.parametrize("tp,state", [
    (b"", "missing"),
    (b"garbage", "invalid"),
    (b"00-00000000000000000000000000000000-00f067aa0ba902b7-01", "invalid"),  # zero trace id
    (b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", "invalid"),  # zero parent
    (b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "invalid"),  # forbidden version
    (b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", "invalid"),  # upper case
])
def test_join_traceparent_states(tp, state):
    j = RequestJoiner()
    j.on_begin(decode(begin_bytes(tp=tp)))
    fr = j.on_end(decode(end_bytes()))
    assert fr.traceparent_state == state and (fr.parent is None)
    assert j.rejected["bad_traceparent"] == (state == "invalid")


def test_join_end_without_begin_record():
    j = RequestJoiner()
    fr = j.on_end(decode(end_bytes(rid=9)))
    assert fr.traceparent_state == "begin_lost" and j.rejected["begin_lost"] == 1


def test_join_error_reasons_and_proc_exit():
    j = RequestJoiner()
    fr = j.on_end(decode(end_bytes(reason=RQ.C["MCP_END_THREAD_EXIT"])))
    assert fr.end_reason == "thread_exit" and fr.is_error
    j.on_begin(decode(begin_bytes(tid=12)))
    x = decode(bytes(RQ.EvProcExit(hdr(RQ.C["MCP_EV_PROC_EXIT"], ctypes.sizeof(RQ.EvProcExit), ts=9000), R.Counters())))
    (lost,) = j.on_proc_exit(x)
    assert lost.end_reason == "process_exit" and lost.tid == 12 and lost.is_error and not j.open


def test_join_expiry_and_orphans():
    j = RequestJoiner()
    j.on_begin(decode(begin_bytes(tid=20, ts=100)))
    j.on_begin(decode(begin_bytes(tid=21, ts=100)))
    fr = j.on_expired(10, 20, 5, 100, 10_000, Counters(1, 0, 0, 0))
    assert fr.end_reason == "expired" and fr.traceparent_state == "valid"
    assert j.drop_orphans(older_than_ns=200, live=set()) == 1 and not j.open


def test_rejected_counts_refusals_not_activity():
    """cu_launch_hits and cu_auto_watch count work done; a rejected metric holding them misleads (the
    H200 run showed 24001 'rejected' that were launches)."""
    from mcp_hostagent.core.health import AgentHealth
    from mcp_hostagent.registry import UNIT

    h = AgentHealth(kernel_stats={"rb_lost": 3, "rb_http_lost": 1, "cu_launch_hits": 24001, "cu_auto_watch": 2,
                                  "mark_bad": 4, "begin_cap": 0}, activity=UNIT.activity_stats())
    assert h.kernel_lost() == 4
    h.rejected["decode_short"] += 1
    h.rejected["mark_bad"] += 1
    assert h.all_rejected() == {"mark_bad": 5, "begin_cap": 0, "decode_short": 1}


def test_kswapd_awake_before_attach_counts_from_its_first_cpu():
    """No wake record can come for a kswapd already in balance_pgdat() when the probes attach: its CPU
    time says it was awake, until its sleep record. A node with records is left to them."""
    from mcp_hostagent.reclaim.rule import KswapdTracker

    k = KswapdTracker()
    assert k.assume_awake(0, 1_000) is True
    assert k.active_ns(0, 3_000, 0) == 2_000
    k.sleep(0, 2_500)
    assert k.active_ns(0, 3_000, 0) == 1_500 and not k.awake_since
    assert k.assume_awake(0, 4_000) is False  # records came since: they decide
    k.wake(1, 100)
    k.sleep(1, 200)
    assert k.assume_awake(1, 300) is False and k.active_ns(0, 1_000, 1) == 100
