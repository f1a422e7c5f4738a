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


# ---- strict heads: what a server must refuse gives no traceparent (agent/http/parse.py) ----------

OK_HEAD = b"GET /x HTTP/1.1\r\nHost: h\r\ntraceparent: " + TPV + b"\r\n\r\n"


@pytest.mark.parametrize("raw, problem", [
    (OK_HEAD, None),
    (b"GET /x HTTP/1.1\r\nHost: h\r\ntraceparent : " + TPV + b"\r\n\r\n", "space_before_colon"),  # RFC 9112 5.1
    (b"GET /x HTTP/1.1\r\nHost: h\r\ntraceparent\t: " + TPV + b"\r\n\r\n", "space_before_colon"),
    (b"GET /x HTTP/1.1\r\nX-A: 1\r\n b\r\ntraceparent: " + TPV + b"\r\n\r\n", "obs_fold"),  # RFC 9112 5.2
    (b"GET /x HTTP/1.1\r\ntraceparent:\r\n\t" + TPV + b"\r\n\r\n", "obs_fold"),
    (b"GET /x HTTP/1.1\r\n Host: h\r\ntraceparent: " + TPV + b"\r\n\r\n", "obs_fold"),  # whitespace, first field
    (b"GET /x HTTP/1.1\nHost: h\ntraceparent: " + TPV + b"\n\n", "bare_lf"),  # RFC 9112 2.2
    (b"GET /x HTTP/1.1\nHost: h\r\ntraceparent: " + TPV + b"\r\n\r\n", "bare_lf"),  # the request line's
    (b"GET /x HTTP/1.1\r\nHost: h\r\ntraceparent: " + TPV + b"\n\r\n", "bare_lf"),
    (b"GET /x HTTP/1.1\r\nHost: h\r\ntraceparent: " + TPV + b"\r\n\n", "bare_lf"),  # the empty line's
    (b"GET /x HTTP/1.1\r\nHost: h\rtraceparent: " + TPV + b"\r\n\r\n", "bare_cr"),
    (b"GET /x HTTP/1.1\r\nHo st: h\r\ntraceparent: " + TPV + b"\r\n\r\n", "bad_field_name"),
    (b"GET /x HTTP/1.1\r\nHost\r\ntraceparent: " + TPV + b"\r\n\r\n", "bad_field_name"),  # no colon
    (b"GET /x HTTP/1.1\r\n: h\r\ntraceparent: " + TPV + b"\r\n\r\n", "bad_field_name"),  # empty name
    (b"GET /x HTTP/1.1\r\nH\xc3\xa9: h\r\ntraceparent: " + TPV + b"\r\n\r\n", "bad_field_name"),
    (b"GET /x HTTP/1.1\r\ntrace(parent): " + TPV + b"\r\n\r\n", "bad_field_name"),
    (b"GET /x HTTP/1.1\r\nHost: h\x00\r\ntraceparent: " + TPV + b"\r\n\r\n", "bad_field_value"),  # RFC 9110 5.5
    (b"GET /x HTTP/1.1\r\nHost: h\x1b[2J\r\ntraceparent: " + TPV + b"\r\n\r\n", "bad_field_value"),
    (b"GET /x HTTP/1.1\r\ntraceparent: " + TPV + b"\x7f\r\n\r\n", "bad_field_value"),
    (b"GET /x HTTP/1.1\r\ntraceparent: " + TPV + b"\r\nTraceParent: " + TPV + b"\r\n\r\n",
     "duplicate_traceparent"),
    (b"GET /x HTTP/1.1\r\ntraceparent: " + TPV + b"\r\ntraceparent: 00-zz\r\n\r\n", "duplicate_traceparent"),
    # the first problem is the one said; a problem after the traceparent voids it as well
    (b"GET /x HTTP/1.1\r\ntraceparent: " + TPV + b"\r\nA : b\r\n c\r\n\r\n", "space_before_colon"),
])
def test_strict_heads(raw, problem):
    h = parse.parse(raw)
    assert h.problem == problem and (h.problem is None or problem in parse.PROBLEMS)
    assert h.traceparent == (TPV if problem is None else None)
    assert (h.method, h.path, h.version, h.complete) == ("GET", "/x", "1.1", True)  # the request line stands


@pytest.mark.parametrize("raw, tp, problem, complete", [
    # only the captured bytes are checked, and a line the capture cut is not read at all: cut after
    # 55 characters, a longer (invalid) value would be a valid one
    (b"GET /x HTTP/1.1\r\ntraceparent: " + TPV, None, None, False),
    (b"GET /x HTTP/1.1\r\ntraceparent: " + TPV + b"\r", None, None, False),
    (b"GET /x HTTP/1.1\r\ntraceparent: " + TPV + b"\r\nHost: h", TPV, None, False),
    (b"GET /x HTTP/1.1\r\ntraceparent: " + TPV + b"\r\nHo st", TPV, None, False),  # cut: unknown, not bad
    (b"GET /x HTTP/1.1\r\n\r\n", None, None, True),
    (b"GET /x HTTP/1.1\r\n\r\nA : b\r\ntraceparent: " + TPV + b"\r\n\r\n", None, None, True),  # a body
    (b"GET /x HTTP/1.1\r\ntraceparent: " + TPV + b"\r\n\r\n\n\n", TPV, None, True),
])
def test_cut_heads_and_bodies(raw, tp, problem, complete):
    h = parse.parse(raw)
    assert (h.traceparent, h.problem, h.complete) == (tp, problem, complete)


@pytest.mark.parametrize("target, path", [
    (b"/v1/chat", "/v1/chat"),
    (b"//user:pw@host/x", "//REDACTED/x"),  # userinfo-shaped: url.path never carries credentials (OTel)
    (b"//token@host/x?a=b", "//REDACTED/x"),
    (b"//host/x", "//host/x"),  # a path a server takes as it is: nothing to hide
    (b"/users/a@b.example/profile", "/users/REDACTED/profile"),
    (b"/a@b@c/d/e@", "/REDACTED/d/REDACTED"),
    (b"/" + b"a" * 126 + b"/u:pw@h", "/" + "a" * 126 + "/"),  # scrubbed before the cut: never "u:pw" alone
    (b"/%40x/%2F", "/%40x/%2F"),  # percent-encoded: as before
    (b"http://user:pw@host/x", "/x"),  # absolute-form: the authority, userinfo and all, is dropped
    (b"https://user:pw@host", "/"),
    (b"HTTP://user:pw@host/a/b?q=1", "/a/b"),  # a scheme is case-insensitive (RFC 3986 3.1)
    (b"http://user:pw@host?x=/y", "/"),
    (b"http://user:pw@host#/y", "/"),
    (b"http://host/a@b/c", "/REDACTED/c"),
    (b"http:/user:pw@host/x", ""),  # neither form
    (b"user:pw@host:443", ""),  # authority-form (CONNECT's): never a path
    (b"host:443", ""),
    (b"*", "*"),  # asterisk-form (OPTIONS *)
    (b"x/y", ""),
    (b"/caf\xc3\xa9", ""),  # not percent-encoded: as before
])
def test_paths(target, path):
    h = parse.parse(b"OPTIONS " + target + b" HTTP/1.1\r\n\r\n")
    assert h.path == path


def test_a_head_with_a_problem_joins_no_trace():
    """The joiner sees no traceparent for a head the server refuses: the span is a root."""
    j = HttpJoiner()
    j.on_begin(begin(1, 100, head=b"GET /x HTTP/1.1\r\ntraceparent : " + TPV + b"\r\n\r\n"))
    fr = j.on_end(end(1, 200, 100))
    assert fr.parent is None and fr.attributes["url.path"] == "/x"


_LINE = st.one_of(
    st.sampled_from([b"Host: h", b"traceparent: " + TPV, b"TRACEPARENT:" + TPV, b"traceparent : " + TPV, b" x",
                     b"\tx", b"A: b\rc", b"a b: c", b"", b"x", b": y", b"@: z", b"Host: \x00", b"tRaceparent:\t" + TPV]),
    st.binary(max_size=40))
_EOL = st.sampled_from([b"\r\n", b"\r\n", b"\n", b"\r", b""])


@given(st.sampled_from([b"GET", b"POST", b"PURGE"]),
       st.one_of(st.binary(min_size=1, max_size=200).filter(lambda b: not any(c in b for c in b" \t\r\n\x0b\x0c")),
                 st.sampled_from([b"//u:p@h/x", b"http://u:p@h/x", b"HtTp://u@h", b"u:p@h:1", b"/a@b"])),
       st.sampled_from([b"\r\n", b"\n"]), st.lists(st.tuples(_LINE, _EOL), max_size=8), st.binary(max_size=30))
def test_fuzz_heads(method, target, eol, lines, tail):
    raw = method + b" " + target + b" HTTP/1.1" + eol + b"".join(a + b for a, b in lines) + tail
    h = parse.parse(raw)
    assert h is not None
    assert h.problem is None or h.problem in parse.PROBLEMS
    assert "@" not in h.path and not any(c.isspace() for c in h.path) and len(h.path) <= parse.MAX_PATH
    assert h.path.isascii() and h.path.isprintable()
    if h.problem is not None:
        assert h.traceparent is None
    if eol == b"\n":
        assert h.problem == "bare_lf"
    if h.traceparent is not None:  # only from a whole line of a head with no problem
        assert b"\r" not in h.traceparent and b"\n" not in h.traceparent
        assert h.traceparent == h.traceparent.strip(b" \t")


@given(st.binary(max_size=1100))
def test_any_bytes_never_raise_nor_leak(raw):
    h = parse.parse(raw)
    assert h is None or ("@" not in h.path and not any(c.isspace() for c in h.path)
                         and (h.problem is None or h.traceparent is None))


def hdr(tgid=10, tid=10, ts=0):
    return Header(0, tgid, tid, 0, ts, 77, b"uvicorn")


def begin(seq, ts, conn=5, faults=0, head=b"GET /x HTTP/1.1\r\ntraceparent: " + TPV + b"\r\n\r\n", group=77,
          tgid=10, tid=10, reads=1, first=None):
    c = Counters(faults=faults)
    return HttpBegin(hdr(tgid, tid, ts=ts), conn, seq, group, ts if first is None else first, 7, reads, False, False,
                     (), head, c, c, c)


def end(seq, ts, begin_ns, conn=5, faults=0, proc=0, status=200, reason="complete", written=100, interim=0, tgid=10):
    return HttpEnd(hdr(tgid, ts=ts), conn, seq, begin_ns, written, interim, 77, 7, 10, status, reason, "length",
                   Counters(faults=faults), Counters(faults=proc), Counters(faults=proc))


def test_a_head_with_a_problem_joins_no_trace():
    """The joiner sees no traceparent for a head the server refuses: the span is a root, said so."""
    rej = Counter()
    j = HttpJoiner(rej)
    j.on_begin(begin(1, 100, head=b"GET /x HTTP/1.1\r\ntraceparent : " + TPV + b"\r\n\r\n"))
    [fr] = j.on_end(end(1, 200, 100))
    assert fr.parent is None and fr.attributes["url.path"] == "/x" and fr.traceparent_state == "invalid"
    assert fr.attributes["hostagent.http.head_problem"] == "space_before_colon"
    assert rej["http_head_space_before_colon"] == 1


def test_join_takes_differences_and_the_clients_parent():
    j = HttpJoiner()
    j.on_begin(begin(1, 100, faults=5))
    [fr] = j.on_end(end(1, 200, 100, faults=12, proc=30))
    assert fr.counters.faults == 7 and dict(fr.scopes)["process"].faults == 25
    assert fr.parent.span_id == 0xb7ad6b7169203331 and fr.traceparent_state == "valid"
    assert fr.request_id == request_id(5, 1) and not fr.is_error and fr.end_reason == "http_complete"
    assert fr.attributes["url.path"] == "/x"
    assert [fr.attributes[f"hostagent.request.{s}.concurrency"] for s in ("thread", "process", "group")] == [1, 1, 1]


def test_concurrency_is_the_peak_while_in_flight_in_each_scope():
    j = HttpJoiner()
    j.on_begin(begin(1, 100, conn=1))
    j.on_begin(begin(1, 110, conn=2, tid=11))
    j.on_begin(begin(1, 120, conn=3, tgid=20, tid=20))  # another process of the same group
    [a] = j.on_end(end(1, 130, 100, conn=1))
    j.on_begin(begin(2, 140, conn=1))
    [b] = j.on_end(end(2, 150, 140, conn=1))
    conc = lambda fr: [fr.attributes[f"hostagent.request.{s}.concurrency"] for s in ("thread", "process", "group")]
    assert conc(a) == [1, 2, 3]
    assert conc(b) == [1, 2, 3]  # conns 2 and 3 still open
    assert not j.open.keys() - {(10, 2, 1), (20, 3, 1)}


def test_a_head_in_several_reads_says_how_long_its_client_took():
    j = HttpJoiner()
    j.on_begin(begin(1, 5_000_100, reads=3, first=100))
    [fr] = j.on_end(end(1, 5_000_200, 5_000_100))
    assert fr.attributes["hostagent.http.request.head_reads"] == 3
    assert fr.attributes["hostagent.http.request.head_wait"] == 0.005


def test_a_counter_that_went_back_is_said_not_subtracted():
    rej = Counter()
    j = HttpJoiner(rej)
    j.on_begin(begin(1, 100, faults=50))
    [fr] = j.on_end(end(1, 200, 100, faults=3, proc=60))  # the thread's entry was evicted and remade
    assert fr.counters.faults == 0 and fr.attributes["hostagent.request.thread.counters"] == "reset"
    assert rej["http_counters_reset"] == 1


def test_lost_begin_and_errors():
    rej = Counter()
    j = HttpJoiner(rej)
    [fr] = j.on_end(end(9, 200, 100, status=0, reason="closed"))
    assert fr.traceparent_state == "begin_lost" and rej["http_begin_lost"] == 1
    assert fr.is_error and fr.error_text == "no HTTP response"
    j.on_begin(begin(1, 100))
    assert j.on_end(end(1, 200, 100, status=502))[0].error_text == "HTTP 502"
    j.on_begin(begin(2, 300))
    [gone] = j.on_gone(10, 5, 400, "process_exit")
    assert gone.is_error and gone.end_reason == "process_exit" and not j.open


def test_a_close_ends_the_requests_behind_the_one_answered_without_a_response():
    j = HttpJoiner()
    for seq in (1, 2, 3):
        j.on_begin(begin(seq, 100 + seq))
    done = j.on_end(end(1, 200, 101, reason="closed", status=200, written=40, interim=25))
    assert [fr.request_id for fr in done] == [request_id(5, s) for s in (1, 2, 3)]
    assert done[0].http_status == 200 and done[0].attributes["hostagent.http.response.size"] == 40
    assert done[0].attributes["hostagent.http.response.interim.size"] == 25
    assert [fr.http_status for fr in done[1:]] == [0, 0] and all(fr.is_error for fr in done[1:])
    assert not j.open


def test_a_marked_processs_request_and_a_late_end_after_expiry_are_dropped():
    rej = Counter()
    j = HttpJoiner(rej)
    j.on_begin(begin(1, 100))
    assert j.on_end(end(1, 200, 100, reason="marked")) == [] and rej["http_marked_process"] == 1 and not j.open
    j.on_begin(begin(2, 300))
    [ex] = j.expire(400, 10_000)
    assert ex.end_reason == "expired" and ex.is_error
    assert j.on_end(end(2, 20_000, 300)) == [] and rej["http_end_after_expiry"] == 1


class _Map(dict):
    def get(self, k, default=None):
        return super().get((k.tgid, k.fd), default)

    def __delitem__(self, k):
        super().__delitem__((k.tgid, k.fd))


def test_without_sock_tracepoints_a_request_head_read_from_a_file_is_not_a_request(tmp_path):
    """On a kernel without sock:sock_*_length the kernel only saw a read starting with a method:
    the capability checks the fd is a socket (/proc/PID/fd/N -> socket:[inode]), drops a file's
    "request" and its END, counts it, and stops the kernel following that fd."""
    from types import SimpleNamespace

    fd_dir = tmp_path / "10" / "fd"
    fd_dir.mkdir(parents=True)
    os.symlink("socket:[4242]", fd_dir / "7")
    os.symlink("/var/log/requests.txt", fd_dir / "8")
    conns = _Map({(10, 7): SimpleNamespace(conn_id=5), (10, 8): SimpleNamespace(conn_id=6)})
    done = []
    rej = Counter()
    from conftest import unstarted_agent

    agent = unstarted_agent({"requests.idle_expiry_s": 60}, proc_root=str(tmp_path))
    agent.ctx.bpf, agent.ctx.finish = {b"http_conn": conns}, done.append
    h = agent.caps["http"]
    h.sock_tracepoints, h.joiner.rejected = False, rej
    h.on_begin(begin(1, 100, conn=5))
    file_begin = HttpBegin(hdr(ts=100), 6, 1, 77, 100, 8, 1, False, False, (), b"GET /x HTTP/1.1\r\n\r\n",
                           Counters(), Counters(), Counters())
    h.on_begin(file_begin)
    h.on_end(end(1, 200, 100, conn=5))
    h.on_end(HttpEnd(hdr(ts=300), 6, 1, 100, 0, 0, 77, 8, 10, 0, "closed", "until_close", Counters(), Counters(),
                     Counters()))
    assert [fr.request_id for fr in done] == [request_id(5, 1)]
    assert rej["http_not_socket"] == 1 and (10, 8) not in conns and (10, 7) in conns
