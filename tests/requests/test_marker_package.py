"""The dependency-free marker package (packaging/marker: mcp_hostagent_marker) and its one-line
integrations: its wire constants and struct are the header's, it imports nothing beyond the standard
library, it builds alone, and (real BPF) its ASGI middleware and OTel span processor mark requests
the agent turns into spans under the caller's trace."""

from __future__ import annotations

import ctypes
import http.client
import os
import shutil
import socket
import subprocess
import sys
import time
import zipfile

import pytest

from conftest import wait_port

import mcp_hostagent_marker as M
from mcp_hostagent.core import records as R
from mcp_hostagent.requests import records as RQ

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
HTTP_TESTS = os.path.join(REPO, "tests", "http")


def test_wire_format_is_the_headers():
    assert (M.MAGIC, M.VERSION, M.MARK_CMD, M.OP_BEGIN, M.OP_END, M.TRACEPARENT_LEN) == (
        RQ.C["MCP_MARK_MAGIC"], RQ.C["MCP_MARK_VERSION"], RQ.C["MCP_MARK_CMD"], RQ.C["MCP_OP_BEGIN"], RQ.C["MCP_OP_END"],
        RQ.C["MCP_TRACEPARENT_LEN"])
    assert ctypes.sizeof(M.Mark) == ctypes.sizeof(RQ.Mark) == 72
    assert [(n, getattr(M.Mark, n).offset) for n, _ in M.Mark._fields_] == \
        [(n, getattr(RQ.Mark, n).offset) for n, _ in RQ.Mark._fields_]


TP00 = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _through_the_agent(traceparent):
    """What the agent makes of begin(traceparent): the marker's struct, copied whole by the kernel
    (requests.bpf.c memcpy's MCP_TRACEPARENT_LEN bytes) into a BEGIN record, decoded and joined."""
    from mcp_hostagent.core import decode as D
    from mcp_hostagent.requests import records
    from mcp_hostagent.requests.join import RequestJoiner

    mark = M.Mark(M.MAGIC, M.VERSION, M.OP_BEGIN, 5, M._wire(M._as_bytes(traceparent)))
    kernel = RQ.EvReqBegin(R.Hdr(RQ.C["MCP_EV_REQ_BEGIN"], ctypes.sizeof(RQ.EvReqBegin), 10, 11, 0, 1000, 77, b"srv"),
                          mark.request_id)
    ctypes.memmove(ctypes.addressof(kernel) + RQ.EvReqBegin.traceparent.offset,
                   ctypes.addressof(mark) + M.Mark.traceparent.offset, M.TRACEPARENT_LEN)
    end = RQ.EvReqEnd(R.Hdr(RQ.C["MCP_EV_REQ_END"], ctypes.sizeof(RQ.EvReqEnd), 10, 11, 0, 5000, 77, b"srv"),
                     5, 1000, 0, 0, R.Counters())
    j = RequestJoiner()
    j.on_begin(D.decode(bytes(kernel), records.DECODERS)[0])
    fr = j.on_end(D.decode(bytes(end), records.DECODERS)[0])
    return fr.traceparent_state, fr.parent


@pytest.mark.parametrize("traceparent, state", [
    (TP00, "valid"),
    (TP00.encode(), "valid"),
    (None, "missing"),
    ("", "missing"),
    # version 00 is exactly 55 characters: cut to 55, these would arrive valid
    (TP00 + "x", "invalid"),
    (TP00 + "-", "invalid"),
    (TP00 + "0" * 200, "invalid"),
    (TP00 + "\0", "invalid"),
    (TP00[:20] + "\0" + TP00[21:], "invalid"),
    (TP00 + " ", "invalid"),
    (TP00 + "\u202e", "invalid"),  # a str's non-ASCII character goes as "?"
    (TP00 + ", " + TP00, "invalid"),  # two fields combined (RFC 9110 5.3)
    # a later version: its first 55 characters, when "-" follows them (W3C's versioning rule)
    ("01" + TP00[2:], "valid"),
    ("01" + TP00[2:] + "-what-comes-next", "valid"),
    ("01" + TP00[2:] + "x", "invalid"),
    ("01" + TP00[2:] + "\0-x", "invalid"),
    ("ff" + TP00[2:] + "-x", "invalid"),
])
def test_an_invalid_traceparent_never_arrives_valid(traceparent, state):
    got, parent = _through_the_agent(traceparent)
    assert got == state
    if state == "valid":
        assert (parent.trace_id, parent.span_id) == (0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7)


def test_wire_bytes():
    assert M._wire(TP00.encode()) == TP00.encode()  # 55 + the struct's NUL
    assert bytes(M.Mark(0, 0, 0, 0, M._wire(TP00.encode())))[16:] == TP00.encode() + b"\0"
    long = (TP00 + "abc").encode()
    assert M._wire(long) == long[:56] and bytes(M.Mark(0, 0, 0, 0, M._wire(long)))[16:] == long[:56]  # no NUL
    assert M._wire(b"a\0b") == b"a?b"


def test_asgi_middleware_combines_two_traceparents(monkeypatch):
    import asyncio

    from mcp_hostagent_marker import asgi

    sent = []
    monkeypatch.setattr(asgi, "begin", lambda rid, tp: sent.append(tp))
    monkeypatch.setattr(asgi, "end", lambda rid: None)

    async def app(scope, receive, send):
        await send({"type": "http.response.body"})

    async def noop(message):
        pass

    for headers, want in (([(b"traceparent", b"a")], b"a"), ([(b"host", b"h")], None),
                          ([(b"traceparent", b"a"), (b"x", b"y"), (b"traceparent", b"b")], b"a, b")):
        sent.clear()
        asyncio.run(asgi.MarkRequests(app)({"type": "http", "headers": headers}, None, noop))
        assert sent == [want]


def test_imports_nothing_beyond_the_standard_library():
    code = ("import sys, mcp_hostagent_marker, mcp_hostagent_marker.asgi; "
            "print(' '.join(sorted(m.split('.')[0] for m in sys.modules)))")
    mods = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())
    assert not mods & {"opentelemetry", "grpc", "pyroute2", "psutil", "bcc", "click", "mcp_hostagent"}, mods


def test_builds_alone_without_dependencies(tmp_path):
    src = tmp_path / "src"  # a copy: setuptools leaves build/ and *.egg-info where it builds
    shutil.copytree(os.path.join(REPO, "packaging", "marker"), src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, capture_output=True)
    (whl,) = out.glob("mcp_hostagent_marker-*.whl")
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert {n.split("/")[0] for n in names if not n.startswith("mcp_hostagent_marker-")} == {"mcp_hostagent_marker"}
    requires = [ln for ln in meta.splitlines() if ln.startswith("Requires-Dist:")]
    assert all("extra == " in ln for ln in requires), requires  # only the optional otel extra


@pytest.mark.bpf
def test_otel_span_processor_marks_server_spans(agent):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import SpanKind

    from mcp_hostagent_marker.otel import MarkServerSpans

    provider = TracerProvider()
    provider.add_span_processor(MarkServerSpans())
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("GET /x", kind=SpanKind.SERVER) as server:
        time.sleep(0.01)
        with tracer.start_as_current_span("inner", kind=SpanKind.INTERNAL):
            pass  # not a SERVER span: no second mark
    ctx = server.get_span_context()
    spans = [s for s in agent.wait_spans(1, **{"process.pid": os.getpid()})
             if s.parent is not None and s.parent.span_id == ctx.span_id]
    assert len(spans) == 1, spans
    s = spans[0]
    assert s.parent.trace_id == ctx.trace_id and s.attributes["hostagent.request.end_reason"] == "marked"
    assert s.attributes["hostagent.request.source"] == "marker"


@pytest.mark.bpf
def test_asgi_middleware_marks_each_request_of_a_fastapi_app(agent):
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    srv = subprocess.Popen([sys.executable, "-m", "uvicorn", "marked_app:marked", "--app-dir", HTTP_TESTS,
                            "--host", "127.0.0.1", "--port", str(port), "--loop", "asyncio", "--http", "h11",
                            "--log-level", "warning"])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/status/204")
                conn.getresponse().read()
                break
            except OSError:
                assert time.monotonic() < deadline and srv.poll() is None
                time.sleep(0.1)
        tps = [f"00-{0xA5170 + i:032x}-{0x700 + i:016x}-01" for i in range(3)]
        for i, tp in enumerate(tps):
            conn.request("GET", f"/touch?pages={50 + i}", headers={"traceparent": tp})
            assert conn.getresponse().read()
        for i in range(3):
            got = [s for s in agent.wait_spans(4, **{"process.pid": srv.pid})
                   if s.parent is not None and s.parent.span_id == 0x700 + i]
            assert len(got) == 1, got  # one span: the marker's (a marking process is not also found by HTTP)
            assert got[0].parent.trace_id == 0xA5170 + i
            assert got[0].attributes["hostagent.request.source"] == "marker"
            assert got[0].attributes["hostagent.faults.user"] >= 50 + i
    finally:
        srv.kill()
        srv.wait()


@pytest.mark.bpf
def test_a_watched_server_that_marks_gets_no_zero_code_span_not_even_for_its_first_request(make_agent):
    """A marking server the agent also watches (by pid here; a GPU server is watched anyway): its
    first request is read before its first marker, so the kernel begins a zero-code request for it;
    that one's END says the process marks, and user space drops it (http_marked_process)."""
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    srv = subprocess.Popen([sys.executable, "-m", "uvicorn", "marked_app:marked", "--app-dir", HTTP_TESTS,
                            "--host", "127.0.0.1", "--port", str(port), "--loop", "asyncio", "--http", "h11",
                            "--log-level", "warning"])
    try:
        wait_port(port, srv, 30)
        agent = make_agent(process__pids=[srv.pid])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        for i in range(3):
            conn.request("GET", f"/touch?pages={10 + i}", headers={"traceparent": f"00-{0xB5170 + i:032x}-{0x800 + i:016x}-01"})
            assert conn.getresponse().read()
        conn.close()
        marked = agent.wait_spans(3, **{"process.pid": srv.pid, "hostagent.request.source": "marker"})
        assert len(marked) == 3
        time.sleep(0.5)
        assert not agent.spans(**{"process.pid": srv.pid, "hostagent.request.source": "http"})
        assert agent.agent.health.rejected["http_marked_process"] >= 1
    finally:
        srv.kill()
        srv.wait()
