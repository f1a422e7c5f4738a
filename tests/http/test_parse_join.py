"""Pure: request heads from any client (hostile ones included) and the BEGIN/END join."""

from __future__ import annotations

import os
from collections import Counter

import pytest
from hypothesis import given, strategies as st

from mcp_hostagent.core.decode import Counters, Header
from mcp_hostagent.http import parse
from mcp_hostagent.http.join import HttpJoiner, request_id
from mcp_hostagent.http.records import HttpBegin, HttpEnd

TPV = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize("raw, method, path, tp, complete", [
    (b"GET /v1/chat?api_key=s3cret HTTP/1.1\r\nHost: x\r\ntraceparent: " + TPV + b"\r\n\r\n",
     "GET", "/v1/chat", TPV, True),
    (b"POST /generate HTTP/1.1\r\nTRACEPARENT:  " + TPV + b"  \r\n\r\n{\"a\":1}", "POST", "/generate", TPV, True),
    (b"GET http://proxy.example/a/b?x=1 HTTP/1.1\r\n\r\n", "GET", "/a/b", None, True),
    (b"GET / HTTP/1.0\r\nHost: x\r\n", "GET", "/", None, False),  # cut before its end
    (b"PURGE /x HTTP/1.1\r\n\r\n", "_OTHER", "/x", None, True),
    (b"GET /" + b"a" * 500 + b" HTTP/1.1\r\n\r\n", "GET", "/" + "a" * 127, None, True),
    (b"GET /\x1b[31mred HTTP/1.1\r\n\r\n", "GET", "", None, True),  # escapes never reach a span
])
def test_heads(raw, method, path, tp, complete):
    h = parse.parse(raw)
    assert (h.method, h.path, h.traceparent, h.complete) == (method, path, tp, complete)


@pytest.mark.parametrize("raw", [b"", b"GET", b"GET / HTTP/2.0\r\n", b"\x16\x03\x01\x02\x00", b"get / HTTP/1.1\r\n"])
def test_not_a_request_line(raw):
    assert parse.parse(raw) is None


@given(st.binary(max_size=1100))
def test_any_bytes_parse_or_are_refused(raw):
    h = parse.parse(raw)
    assert h is None or (len(h.path) <= parse.MAX_PATH and h.path.isascii())


def hdr(tgid=10, tid=10, ts=0):
    return Header(0, tgid, tid, 0, ts, 77, b"uvicorn")


def begin(seq, ts, conn=5, faults=0, head=b"GET /x HTTP/1.1\r\ntraceparent: " + TPV + b"\r\n\r\n"):
    c = Counters(faults=faults)
    return HttpBegin(hdr(ts=ts), conn, seq, 77, 7, head, c, c, c)


def end(seq, ts, begin_ns, conn=5, faults=0, proc=0, status=200, reason="complete"):
    return HttpEnd(hdr(ts=ts), conn, seq, begin_ns, 100, 77, 7, 10, status, reason, "length",
                   Counters(faults=faults), Counters(faults=proc), Counters(faults=proc))


def test_join_takes_differences_and_the_clients_parent():
    j = HttpJoiner()
    j.on_begin(begin(1, 100, faults=5))
    fr = j.on_end(end(1, 200, 100, faults=12, proc=30))
    assert fr.counters.faults == 7 and dict(fr.scopes)["process"].faults == 25
    assert fr.parent.span_id == 0xb7ad6b7169203331 and fr.traceparent_state == "valid"
    assert fr.request_id == request_id(5, 1) and not fr.is_error and fr.end_reason == "http_complete"
    assert fr.attributes["url.path"] == "/x" and fr.attributes["hostagent.request.concurrency"] == 1


def test_concurrency_is_the_peak_while_in_flight():
    j = HttpJoiner()
    j.on_begin(begin(1, 100, conn=1))
    j.on_begin(begin(1, 110, conn=2))
    j.on_begin(begin(1, 120, conn=3))
    a = j.on_end(end(1, 130, 100, conn=1))
    j.on_begin(begin(2, 140, conn=1))
    b = j.on_end(end(2, 150, 140, conn=1))
    assert a.attributes["hostagent.request.concurrency"] == 3
    assert b.attributes["hostagent.request.concurrency"] == 3  # conns 2 and 3 still open
    assert not j.open.keys() - {(10, 2, 1), (10, 3, 1)}


def test_a_counter_that_went_back_is_said_not_subtracted():
    rej = Counter()
    j = HttpJoiner(rej)
    j.on_begin(begin(1, 100, faults=50))
    fr = j.on_end(end(1, 200, 100, faults=3, proc=60))  # the thread's entry was evicted and remade
    assert fr.counters.faults == 0 and fr.attributes["hostagent.request.thread.counters"] == "reset"
    assert rej["http_counters_reset"] == 1


def test_lost_begin_and_errors():
    rej = Counter()
    j = HttpJoiner(rej)
    fr = j.on_end(end(9, 200, 100, status=0, reason="closed"))
    assert fr.traceparent_state == "begin_lost" and rej["http_begin_lost"] == 1
    assert fr.is_error and fr.error_text == "no HTTP response"
    j.on_begin(begin(1, 100))
    assert j.on_end(end(1, 200, 100, status=502)).error_text == "HTTP 502"
    j.on_begin(begin(2, 300))
    gone = j.on_gone(10, 5, 2, 400, "process_exit")
    assert gone.is_error and gone.end_reason == "process_exit" and not j.open


class _Map(dict):
    def get(self, k, default=None):
        return super().get((k.tgid, k.fd), default)

    def __delitem__(self, k):
        super().__delitem__((k.tgid, k.fd))


def test_a_request_head_read_from_a_file_is_not_a_request(tmp_path):
    """The kernel only saw a read starting with a method: the capability checks the fd is a socket
    (/proc/PID/fd/N -> socket:[inode]), drops a file's "request" and its END, counts it, and stops
    the kernel following that fd."""
    from types import SimpleNamespace

    from mcp_hostagent.http.capability import Http

    fd_dir = tmp_path / "10" / "fd"
    fd_dir.mkdir(parents=True)
    os.symlink("socket:[4242]", fd_dir / "7")
    os.symlink("/var/log/requests.txt", fd_dir / "8")
    conns = _Map({(10, 7): SimpleNamespace(conn_id=5), (10, 8): SimpleNamespace(conn_id=6)})
    done = []
    rej = Counter()
    h = Http({b"http_conn": conns}, finish=done.append, idle_expiry_s=60, rejected=rej, proc_root=str(tmp_path))
    h.on_begin(begin(1, 100, conn=5))
    file_begin = HttpBegin(hdr(ts=100), 6, 1, 77, 8, b"GET /x HTTP/1.1\r\n\r\n", Counters(), Counters(), Counters())
    h.on_begin(file_begin)
    h.on_end(end(1, 200, 100, conn=5))
    h.on_end(HttpEnd(hdr(ts=300), 6, 1, 100, 0, 77, 8, 10, 0, "closed", "unknown", Counters(), Counters(), Counters()))
    assert [fr.request_id for fr in done] == [request_id(5, 1)]
    assert rej["http_not_socket"] == 1 and (10, 8) not in conns and (10, 7) in conns
