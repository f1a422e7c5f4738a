"""The real-server harness on its own (no agent, no BPF): every server kind of tests/http/realservers.py
answers every endpoint through tests/http/rawclient.py, in the byte-level scenarios the zero-code HTTP
tests use (split heads, pipelining, a body that looks like a request, Expect: 100-continue, chunked
request bodies, keep-alive), and gunicorn's --max-requests re-forks its workers.

What each server does is pinned here as observed (gunicorn's sync worker has no keep-alive: it answers
one request per connection, with Connection: close, and drops the rest), so a change of behaviour in a
server release shows up here first, not as a puzzling span in the agent's tests.
"""

from __future__ import annotations

import json
import os
import time

import pytest

import rawclient as rc
import realservers

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
ONE_PER_CONNECTION = {"gunicorn-sync"}  # Connection: close after each response; no keep-alive
SENDS_100_CONTINUE = set(realservers.KINDS)  # all of them, before the handler reads the body


IN_CI = os.environ.get("CI") == "true"


def need(kind: str) -> None:
    """scripts/setup.sh installs every server, so CI must have them all: there a missing one fails."""
    reason = realservers.available(kind)
    if reason:
        if IN_CI:
            pytest.fail(f"{kind}: {reason}")
        pytest.skip(f"{kind}: {reason}")


@pytest.fixture(scope="module", params=realservers.KINDS)
def server(request):
    need(request.param)
    s = realservers.start(request.param)
    yield s
    s.close()


def answers(kind: str, n: int) -> int:
    return 1 if kind in ONE_PER_CONNECTION else n


def check_wire(rs: rc.Responses) -> None:
    """The parsed responses account for every byte received."""
    assert sum(r.raw_len for r in rs) + len(rs.leftover) == rs.received, rs
    for r in rs:
        assert r.raw_len == r.head_len + r.framed_body_len and r.head_len > 0, r


def fast_ok(r: rc.Response) -> None:
    assert (r.status, r.body, r.chunked) == (200, b"fast\n", False), r
    assert int(r.headers["content-length"]) == 5 and r.framed_body_len == 5, r


# ---------------------------------------------------------------- endpoints
def test_endpoints(server):
    [r] = rc.request(server.port, rc.build_request("GET", "/fast"))
    fast_ok(r)

    rs = rc.request(server.port, rc.build_request("GET", "/slow?ms=150"))
    assert rs[0].status == 200 and rs[0].body == b"slow\n", rs
    assert rs[0].t_last_ns - rs.t_sent_ns >= 150e6, "the handler did not sleep"

    for method in ("POST", "PUT"):
        [r] = rc.request(server.port, rc.build_request(method, "/echo", {}, b"x" * 3000))
        assert r.status == 200 and json.loads(r.body) == {"len": 3000}, r
        assert int(r.headers["content-length"]) == r.body_len

    rs = rc.request(server.port, rc.build_request("GET", "/stream?events=4&gap_ms=40"))
    check_wire(rs)
    [r] = rs
    assert r.status == 200 and r.chunked and "content-length" not in r.headers, r
    assert r.body == b"".join(b"data: %d\n\n" % i for i in range(4)), r.body
    assert r.t_last_ns - r.t_first_ns >= 3 * 40e6 * 0.9, "events were not sent gap_ms apart"

    [r] = rc.request(server.port, rc.build_request("GET", "/pid"))
    info = json.loads(r.body)
    assert info["pid"] in server.pids(), (info, server.pids())
    if server.kind.startswith("gunicorn"):
        assert info["pid"] != server.pid, "a gunicorn master served a request"
        assert info["tid"] in [int(t) for t in os.listdir(f"/proc/{info['pid']}/task")]


# ---------------------------------------------------------------- split heads
REQ = rc.build_request("GET", "/fast", {"traceparent": TP, "User-Agent": "rawclient"})
MID_TP = REQ.index(b"traceparent: ") + len("traceparent: ") + 20
SPLITS = {"1": 1, "2": 2, "3": 3, "4": 4, "15": 15, "mid-traceparent": MID_TP, "last-byte": len(REQ) - 1}


@pytest.mark.parametrize("at", list(SPLITS), ids=list(SPLITS))
def test_split_head(server, at):
    rs = rc.send_split(server.port, REQ, SPLITS[at], gap_s=0.02)
    check_wire(rs)
    assert len(rs) == 1 and not rs.leftover and rs.error is None, rs
    fast_ok(rs[0])


def test_split_head_many_pieces(server):
    """A head in one-byte writes up to past the traceparent, then the rest."""
    rs = rc.send_split(server.port, REQ, list(range(1, MID_TP + 8)), gap_s=0.001)
    assert len(rs) == 1, rs
    fast_ok(rs[0])


# ---------------------------------------------------------------- pipelining, keep-alive
def test_pipelined_pair(server):
    a = rc.build_request("GET", "/fast", {"traceparent": TP})
    b = rc.build_request("GET", "/pid")
    rs = rc.pipelined(server.port, [a, b])
    check_wire(rs)
    assert len(rs.final) == answers(server.kind, 2), rs
    fast_ok(rs[0])
    if server.kind in ONE_PER_CONNECTION:
        assert rs[0].headers.get("connection", "").lower() == "close" and rs.closed, rs
    else:
        assert rs[1].status == 200 and json.loads(rs[1].body)["pid"] in server.pids(), rs


def test_late_pipelined(server):
    """The second request arrives while the first one's handler runs (Go reads its first byte in the
    background then: read(fd, buf, 1); Node and aiohttp read it whole before answering the first)."""
    a = rc.build_request("GET", "/slow?ms=150")
    b = rc.build_request("GET", "/fast")
    rs = rc.send_split(server.port, a + b, len(a), gap_s=0.05, expect=2)
    check_wire(rs)
    assert len(rs.final) == answers(server.kind, 2), rs
    assert rs[0].body == b"slow\n"
    if len(rs) == 2:
        fast_ok(rs[1])


def test_keepalive(server):
    reqs = [rc.build_request("GET", "/fast", {"traceparent": TP}), rc.build_request("POST", "/echo", {}, b"abc"),
            rc.build_request("GET", "/fast")]
    rs = rc.keepalive(server.port, reqs, gap_s=0.05)
    check_wire(rs)
    assert len(rs.final) == answers(server.kind, 3), rs
    fast_ok(rs[0])
    if len(rs) == 3:
        assert json.loads(rs[1].body) == {"len": 3}
        fast_ok(rs[2])


# ---------------------------------------------------------------- bodies
BODY_LIKE_REQUEST = b"PUT /x HTTP/1.1\r\nHost: y\r\nContent-Length: 0\r\n\r\n"


@pytest.mark.parametrize("split", [False, True], ids=["one-write", "body-in-own-segment"])
def test_body_begins_with_method(server, split):
    req = rc.build_request("POST", "/echo", {"traceparent": TP}, BODY_LIKE_REQUEST)
    at = len(req) - len(BODY_LIKE_REQUEST) if split else []
    rs = rc.send_split(server.port, req, at, gap_s=0.03)
    check_wire(rs)
    assert len(rs) == 1 and not rs.leftover, rs
    assert rs[0].status == 200 and json.loads(rs[0].body) == {"len": len(BODY_LIKE_REQUEST)}, rs


def test_expect_continue(server):
    body = b"e" * 777
    rs = rc.expect_continue(server.port, "/echo", body, {"traceparent": TP})
    check_wire(rs)
    sends = server.kind in SENDS_100_CONTINUE
    assert rs.continue_ == ("100" if sends else "timeout"), rs
    if sends:
        assert [(r.status, r.raw_len) for r in rs.interim] == [(100, len(b"HTTP/1.1 100 Continue\r\n\r\n"))], rs
    [final] = rs.final
    assert final.status == 200 and json.loads(final.body) == {"len": len(body)}, rs


@pytest.mark.parametrize("gap_s", [None, 0.02], ids=["one-write", "chunk-per-write"])
def test_chunked_request_body(server, gap_s):
    chunks = [b"a" * 5, b"b" * 1000, b"c"]
    rs = rc.chunked_body(server.port, "/echo", chunks, headers={"traceparent": TP}, gap_s=gap_s)
    check_wire(rs)
    assert len(rs) == 1, rs
    assert rs[0].status == 200 and json.loads(rs[0].body) == {"len": 1006}, rs


# ---------------------------------------------------------------- gunicorn workers
def test_gunicorn_sync_max_requests_reforks():
    need("gunicorn-sync")
    with realservers.start("gunicorn-sync", workers=2, max_requests=5) as s:
        first = set(s.worker_pids())
        assert len(first) == 2 and s.pid not in first
        served = []
        for _ in range(30):
            [r] = rc.request(s.port, rc.build_request("GET", "/pid"))
            assert r.status == 200, r
            served.append(json.loads(r.body)["pid"])
        assert s.pid not in served
        # 30 requests (and the readiness probe), 5 a worker: at least 6 workers served them
        assert len(set(served)) >= 6, served
        assert s.alive() and s.pids()[0] == s.pid
        deadline = time.monotonic() + 10
        while len(s.worker_pids()) != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(s.worker_pids()) == 2 and not first & set(s.worker_pids()), (first, s.worker_pids())
        tree = s.pids()
    assert not realservers.running(tree), "close() left processes running"


# ---------------------------------------------------------------- cgroup
def cgroup2_root() -> str | None:
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            if fstype == "cgroup2":
                return mnt
    return None


def test_start_in_cgroup():
    root = cgroup2_root()
    if os.geteuid() != 0 or not root:
        pytest.skip("needs root and a cgroup v2 hierarchy")
    kind = "gunicorn-gthread"
    need(kind)
    cg = os.path.join(root, f"mcp-test-realservers-{os.getpid()}-{time.monotonic_ns()}")
    os.mkdir(cg)
    try:
        with realservers.start(kind, cgroup=cg, workers=2) as s:
            procs = {int(p) for p in open(os.path.join(cg, "cgroup.procs")).read().split()}
            assert set(s.pids()) == procs and s.pid in procs and len(procs) == 3, (s.pids(), procs)
            [r] = rc.request(s.port, rc.build_request("GET", "/pid"))
            assert json.loads(r.body)["pid"] in procs
    finally:
        for _ in range(100):
            try:
                os.rmdir(cg)
                break
            except OSError:
                time.sleep(0.05)
