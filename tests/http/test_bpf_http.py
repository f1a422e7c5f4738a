"""Real BPF, real servers: zero-code HTTP requests of an unmodified FastAPI app under uvicorn (both
from PyPI), with no marker and no OTel in the server. Spans are checked against the client's own ids
and clocks, and their counters against the kernel's accounting in /proc (minflt + majflt of the
thread, the process, and every process of the server's cgroup), read before and after each request.

Each request runs alone (except in the concurrency test), so a thread's /proc delta around the
request bounds the kernel's count inside it from above, and what the endpoint measured around its
own work bounds it from below.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import wait_port

pytestmark = pytest.mark.bpf
HERE = os.path.dirname(os.path.abspath(__file__))
TP = "00-{trace:032x}-{span:016x}-01"
PAGES = 400


def stat_fields(path: str) -> list[str]:
    """A /proc stat file's fields after the command name (from field 3, the state, on)."""
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()


def faults(path: str) -> int:
    """minflt + majflt of a /proc stat file (fields 10 and 12): what exceptions:page_fault_user counts."""
    x = stat_fields(path)
    return int(x[7]) + int(x[9])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """uvicorn serving tests/http/fastapi_app.py in a cgroup v2 of its own (its serving group)."""

    def __init__(self):
        from mcp_hostagent.requests.owners import cgroup2_root

        root = cgroup2_root()
        assert root, "no cgroup v2 hierarchy: the serving group cannot be tested"
        self.cgroup = os.path.join(root, f"mcp-test-http-{os.getpid()}-{time.monotonic_ns()}")
        os.mkdir(self.cgroup)
        self.port = free_port()
        self.proc = subprocess.Popen(
            ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', self.cgroup, sys.executable, "-m", "uvicorn",
             "fastapi_app:app", "--app-dir", HERE, "--host", "127.0.0.1", "--port", str(self.port),
             "--loop", "asyncio", "--http", "h11", "--log-level", "warning", "--timeout-keep-alive", "30"])
        self.pid = self.proc.pid
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and self.proc.poll() is None, "uvicorn did not start"
                time.sleep(0.1)

    def group_faults(self) -> int:
        total = 0
        for pid in open(os.path.join(self.cgroup, "cgroup.procs")).read().split():
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    total += faults(f"/proc/{pid}/task/{tid}/stat")
                except OSError:
                    pass
        return total

    def close(self):
        self.proc.kill()
        self.proc.wait()
        for _ in range(100):
            try:
                for pid in open(os.path.join(self.cgroup, "cgroup.procs")).read().split():
                    try:
                        os.kill(int(pid), 9)
                    except ProcessLookupError:
                        pass
                os.rmdir(self.cgroup)
                return
            except OSError:
                time.sleep(0.1)


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.close()


@pytest.fixture(scope="module")
def agent(server):
    from conftest import RunningAgent

    a = RunningAgent({"process.pids": [server.pid]})
    yield a
    a.close()


def exec_ns(path: str) -> int:
    """sum_exec_runtime: the first field of /proc/PID/task/TID/schedstat (CONFIG_SCHED_INFO), read once
    the thread is off the CPU. The file reads se.sum_exec_runtime as it stands, and for a running task
    that lags until the next update_curr (a tick, or its switch): a CI run read 39,649 ns for a request
    the thread served in 2.04 ms without a switch. Blocked (state S or D), its dequeue has updated it;
    the state is set just before schedule(), so the read waits 1 ms more for that switch."""
    stat = os.path.join(os.path.dirname(path), "stat")
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            if stat_fields(stat)[0] in ("S", "D"):
                time.sleep(0.001)
                break
        except OSError:
            break
        time.sleep(0.001)
    try:
        return int(open(path).read().split()[0])
    except (OSError, IndexError):
        pytest.skip("no /proc/PID/task/TID/schedstat (CONFIG_SCHED_INFO)")


def request(conn, method: str, path: str, trace: int, span: int):
    conn.request(method, path, headers={"traceparent": TP.format(trace=trace, span=span)})
    r = conn.getresponse()
    return r.status, r.read()


def span_for(agent, trace: int, span: int, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        for s in agent.spans():
            if s.parent is not None and s.parent.trace_id == trace and s.parent.span_id == span:
                return s
        assert time.monotonic() < deadline, f"no span with parent {trace:x}/{span:x}"
        time.sleep(0.1)


def test_requests_of_an_unmodified_server_become_spans_under_the_clients_trace(agent, server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port)  # one keep-alive connection
    sent = []
    for i, path in enumerate(["/touch?pages=1", "/status/204", "/status/503", "/touch?pages=2&secret=x"]):
        t0 = time.monotonic_ns()
        status, _ = request(conn, "GET", path, 0xABC0 + i, 0x100 + i)
        sent.append((path, status, time.monotonic_ns() - t0, 0xABC0 + i, 0x100 + i))
    conn.close()
    for path, status, rtt, trace, span in sent:
        s = span_for(agent, trace, span)
        a = s.attributes
        assert a["hostagent.request.source"] == "http"
        assert a["http.request.method"] == "GET"
        assert a["url.path"] == path.split("?")[0]  # the query string never leaves the host
        assert a["http.response.status_code"] == status
        assert a["hostagent.request.end_reason"] == "http_complete", dict(a)
        assert a["hostagent.http.response.framing"] == "length"
        assert a["process.pid"] == server.pid
        assert 0 < s.end_time - s.start_time <= rtt, (path, s.end_time - s.start_time, rtt)
        assert (s.status.status_code.name == "ERROR") == (status >= 500), (path, s.status)
    assert "secret" not in json.dumps([dict(s.attributes) for s in agent.spans()])


def test_thread_counts_are_the_kernels_for_the_event_loop_thread(agent, server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port)
    request(conn, "GET", "/touch?pages=1", 1, 1)  # the connection is open, the loop thread known
    for i in range(3):
        tid = server.pid  # asyncio's loop runs on uvicorn's main thread
        before = faults(f"/proc/{server.pid}/task/{tid}/stat")
        cpu0 = exec_ns(f"/proc/{server.pid}/task/{tid}/schedstat")
        status, body = request(conn, "GET", f"/touch?pages={PAGES}", 0xF00, 0x10 + i)
        cpu1 = exec_ns(f"/proc/{server.pid}/task/{tid}/schedstat")
        after = faults(f"/proc/{server.pid}/task/{tid}/stat")
        inner = json.loads(body)
        assert status == 200 and inner["tid"] == tid and inner["faults"] >= PAGES
        sp = span_for(agent, 0xF00, 0x10 + i)
        a = sp.attributes
        assert a["thread.id"] == tid
        assert inner["faults"] <= a["hostagent.faults.user"] <= after - before, (inner, dict(a), after - before)
        # its CPU time: split at the head read and the response write, so within the span and within
        # what the kernel's sum_exec_runtime counted for the thread around the request
        oncpu = round(a["hostagent.oncpu.time"] * 1e9)  # exported in s: back to the kernel's ns
        # (a request served without a switch is on the CPU from its begin to its end: equal, to the ns)
        assert 0 < oncpu <= min(cpu1 - cpu0, sp.end_time - sp.start_time), (oncpu, cpu1 - cpu0, sp.end_time - sp.start_time)
    conn.close()


def test_thread_pool_hand_off_shows_in_the_process_not_the_thread(agent, server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port)
    request(conn, "GET", "/handoff?pages=1", 2, 1)
    before = faults(f"/proc/{server.pid}/stat")
    status, body = request(conn, "GET", f"/handoff?pages={PAGES}", 0xF01, 0x20)
    after = faults(f"/proc/{server.pid}/stat")
    conn.close()
    inner = json.loads(body)
    assert status == 200 and inner["tid"] != server.pid, inner  # it ran on a pool thread
    a = span_for(agent, 0xF01, 0x20).attributes
    assert inner["faults"] <= a["hostagent.request.process.faults.user"] <= after - before, (inner, dict(a))
    # the loop thread did not do the pool thread's work
    assert a["hostagent.faults.user"] < inner["faults"], dict(a)


def test_work_handed_to_an_engine_process_shows_in_the_serving_group(agent, server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port)
    request(conn, "GET", "/engine/pid", 3, 1)
    request(conn, "POST", "/engine?pages=1", 3, 2)  # the worker process runs
    before = server.group_faults()
    status, body = request(conn, "POST", f"/engine?pages={PAGES}", 0xF02, 0x30)
    after = server.group_faults()
    conn.close()
    inner = json.loads(body)
    assert status == 200 and inner["pid"] != server.pid, inner
    a = span_for(agent, 0xF02, 0x30).attributes
    assert inner["faults"] <= a["hostagent.request.group.faults.user"] <= after - before, (inner, dict(a), after - before)
    assert a["hostagent.request.process.faults.user"] < inner["faults"], dict(a)  # not the server's own


def test_a_streamed_response_ends_with_its_last_event(agent, server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port)
    t0 = time.monotonic_ns()
    status, body = request(conn, "GET", "/stream?events=6&gap_ms=50", 0xF03, 0x40)
    rtt = time.monotonic_ns() - t0
    conn.close()
    assert status == 200 and body.count(b"data:") == 6
    s = span_for(agent, 0xF03, 0x40)
    a = s.attributes
    assert a["hostagent.http.response.framing"] == "chunked"
    assert a["hostagent.request.end_reason"] == "http_complete"
    assert 6 * 50e6 <= s.end_time - s.start_time <= rtt, (s.end_time - s.start_time, rtt)


def test_concurrent_keep_alive_clients_each_get_their_own_spans(agent, server):
    n_clients, per_client = 6, 5
    errors = []

    def client(c: int) -> None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", server.port)
            for i in range(per_client):
                status, _ = request(conn, "GET", "/stream?events=2&gap_ms=20", 0xC000 + c, 0x1 + i)
                assert status == 200
            conn.close()
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    peaks = []
    for c in range(n_clients):
        for i in range(per_client):
            a = span_for(agent, 0xC000 + c, 0x1 + i).attributes
            assert a["hostagent.request.end_reason"] == "http_complete"
            peaks.append(a["hostagent.request.process.concurrency"])
    assert max(peaks) > 1, peaks  # overlapping requests say they shared the process's evidence


def test_a_client_gone_mid_stream_ends_the_request_as_closed(agent, server):
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(b"GET /stream?events=40&gap_ms=50 HTTP/1.1\r\nHost: x\r\ntraceparent: "
              + TP.format(trace=0xF04, span=0x50).encode() + b"\r\n\r\n")
    assert s.recv(4096).startswith(b"HTTP/1.1 200")
    s.close()
    span = span_for(agent, 0xF04, 0x50, timeout=15)
    a = span.attributes
    assert a["hostagent.request.end_reason"] == "http_closed", dict(a)
    assert span.end_time - span.start_time < 40 * 50e6  # ended by the close, not the stream's end


def test_an_unwatched_server_gets_no_spans(agent):
    other = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port := free_port())],
                             cwd=HERE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                request(conn, "GET", "/", 0xF05, 0x60)
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        time.sleep(0.5)
        assert not [s for s in agent.spans() if s.parent is not None and s.parent.trace_id == 0xF05]
    finally:
        other.kill()
        other.wait()


def test_tree_groups_follow_the_servers_children_not_its_cgroup(make_agent):
    """requests.group = tree: the server shares its cgroup with this test's processes, and its group
    is its process tree alone: the engine process it forks, not the neighbours."""
    port = free_port()
    srv = subprocess.Popen([sys.executable, "-m", "uvicorn", "fastapi_app:app", "--app-dir", HERE, "--host", "127.0.0.1",
                            "--port", str(port), "--loop", "asyncio", "--http", "h11", "--log-level", "warning"],
                           start_new_session=True)  # its group: killed with the engine it forks
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and srv.poll() is None, "uvicorn did not start"
                time.sleep(0.1)
        a = make_agent(process__pids=[srv.pid], requests__group="tree")
        assert a.agent.plan.statuses["watch_fork"].state == "attached"
        conn = http.client.HTTPConnection("127.0.0.1", port)
        request(conn, "GET", "/engine/pid", 5, 1)  # the server roots its tree, then forks the engine
        engine = json.loads(request(conn, "GET", "/engine/pid", 5, 2)[1])["pid"]
        request(conn, "POST", "/engine?pages=1", 5, 3)
        tree = (f"/proc/{srv.pid}", f"/proc/{engine}")
        before = sum(faults(f"{p}/task/{t}/stat") for p in tree for t in os.listdir(f"{p}/task"))
        status, body = request(conn, "POST", f"/engine?pages={PAGES}", 0xF06, 0x70)
        after = sum(faults(f"{p}/task/{t}/stat") for p in tree for t in os.listdir(f"{p}/task"))
        conn.close()
        inner = json.loads(body)
        assert status == 200 and inner["pid"] == engine
        at = span_for(a, 0xF06, 0x70).attributes
        assert at["hostagent.request.group.root_pid"] == srv.pid
        assert inner["faults"] <= at["hostagent.request.group.faults.user"] <= after - before, (inner, dict(at))
    finally:
        os.killpg(srv.pid, signal.SIGKILL)
        srv.wait()


def test_tree_groups_hold_an_engine_forked_at_start_before_any_request(make_agent):
    """vLLM's shape: the front end forks its engine at start, before the agent runs and before any
    request; requests.group = tree, watched by the front end's pid. The engine joins the front end's
    tree when the front end joins the watch set (its existing descendants), so each request's group
    figures hold the engine's work: within the kernel's own counts of both processes."""
    port = free_port()
    srv = subprocess.Popen([sys.executable, os.path.join(HERE, "engine_server.py"), str(port)], start_new_session=True)
    try:
        wait_port(port, srv, 20)
        engine = int(open(f"/proc/{srv.pid}/task/{srv.pid}/children").read().split()[0])
        a = make_agent(process__pids=[srv.pid], requests__group="tree")
        tree = (f"/proc/{srv.pid}", f"/proc/{engine}")
        conn = http.client.HTTPConnection("127.0.0.1", port)
        for i in range(5):
            before = sum(faults(f"{p}/task/{t}/stat") for p in tree for t in os.listdir(f"{p}/task"))
            status, body = request(conn, "POST", f"/work?pages={PAGES}", 0xF10, 0x80 + i)
            after = sum(faults(f"{p}/task/{t}/stat") for p in tree for t in os.listdir(f"{p}/task"))
            inner = json.loads(body)
            assert status == 200 and inner["pid"] == engine
            at = span_for(a, 0xF10, 0x80 + i).attributes
            assert at["hostagent.request.group.root_pid"] == srv.pid
            assert at["hostagent.request.group.concurrency"] == 1
            assert inner["faults"] <= at["hostagent.request.group.faults.user"] <= after - before, (inner, dict(at))
            assert at["hostagent.request.process.faults.user"] < inner["faults"]  # not the front end's own
        conn.close()
    finally:
        os.killpg(srv.pid, signal.SIGKILL)
        srv.wait()
