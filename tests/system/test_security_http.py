"""The zero-code HTTP path under attack by a hostile unprivileged user (uid 4242, in a cgroup of its
own), against the real `mcp-agent run`, while a legitimate, unmodified Go net/http server (root,
watched by its pid) answers 200 requests of a legitimate client, each with its own traceparent. Each
attack: the legitimate client gets >= 99% right spans (its trace, path, status, the response's size),
the agent stays up and stops within 5 s of SIGTERM, and what was refused is in
hostagent.agent.records.rejected.

Measured on the tree before the framing engine and device-identity discovery (issue 37): the
socketpair fill left 0 of 200 legitimate spans, slowloris 0 of 200, a 16-process ring flood 129 of 300.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "http"))
import rawclient as rc  # noqa: E402
import realservers as rs  # noqa: E402
from test_reliability import jsonl_requests, last_counter  # noqa: E402
from test_security_blinding import HOSTILE_UID, as_hostile, hostile_cgroup, reachable, run_agent, stop  # noqa: E402,F401

pytestmark = pytest.mark.bpf
N_LEGIT = 200


@pytest.fixture(scope="module")
def hostile_dir(tmp_path_factory):
    """A directory uid 4242 owns and reaches (pytest's tmp is root's, 0700): the hostile script, and
    copies of python3 under names of their own (a process's comm is its executable's name)."""
    d = tmp_path_factory.mktemp("hostile_http")
    shutil.copy(os.path.join(HERE, "hostile_http.py"), d / "hostile_http.py")
    for name in ("hostile-srv", "vllm"):
        shutil.copy(os.path.realpath("/usr/bin/python3"), d / name)  # Debian's: its stdlib is not in root's home
    for p in d.iterdir():
        os.chmod(p, 0o755)
    os.chown(d, HOSTILE_UID, HOSTILE_UID)
    os.chmod(d, 0o755)
    reachable(d)
    return d


@pytest.fixture
def legit():
    if rs.available("go"):
        pytest.fail(f"go: {rs.available('go')}")
    s = rs.start("go")
    yield s
    s.close()


def http_spans(path) -> dict:
    """(trace id, parent span id) hex -> [span attributes], from the agent's OTLP-JSON lines."""
    out: dict = {}
    for req in jsonl_requests(path):
        for rsp in req.get("resourceSpans", []):
            for ss in rsp["scopeSpans"]:
                for s in ss["spans"]:
                    a = {kv["key"]: next(iter(kv["value"].values())) for kv in s.get("attributes", [])}
                    if a.get("hostagent.request.source") == "http" and s.get("parentSpanId"):
                        out.setdefault((s["traceId"], s["parentSpanId"]), []).append(a)
    return out


def http_spans_all(path) -> list:
    """The attributes of every zero-code span, with a parent or none."""
    out = []
    for req in jsonl_requests(path):
        for rsp in req.get("resourceSpans", []):
            for ss in rsp["scopeSpans"]:
                for s in ss["spans"]:
                    a = {kv["key"]: next(iter(kv["value"].values())) for kv in s.get("attributes", [])}
                    if a.get("hostagent.request.source") == "http":
                        out.append([a])
    return out


def legit_round(port: int, base: int, n: int = N_LEGIT):
    """n requests on keep-alive connections of 20: [(key, path, response)]."""
    sent = []
    for c in range(n // 20):
        reqs, keys = [], []
        for i in range(20):
            t = base + c * 20 + i
            reqs.append(rc.build_request("GET", "/fast", {"traceparent": f"00-{t:032x}-{t:016x}-01"}))
            keys.append((f"{t:032x}", f"{t:016x}"))
        got = rc.keepalive(port, reqs)
        sent += [(k, "/fast", r) for k, r in zip(keys, got.final)]
        sent += [(k, "/fast", None) for k in keys[len(got.final):]]
    return sent


def check_legit(agent, sent) -> None:
    deadline = time.monotonic() + 30
    while True:
        found = http_spans(agent.jsonl)
        right = [k for k, path, r in sent if r is not None and len(found.get(k, [])) == 1
                 and found[k][0].get("url.path") == path
                 and int(found[k][0].get("http.response.status_code", 0)) == r.status
                 and int(found[k][0].get("hostagent.http.response.size", -1)) == r.raw_len]
        if len(right) >= len(sent) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    print(f"legit: {len(right)} of {len(sent)} right spans")
    if len(right) < 0.99 * len(sent):
        rej = last_counter(jsonl_requests(agent.jsonl), "hostagent.agent.records.rejected")
        lost = last_counter(jsonl_requests(agent.jsonl), "hostagent.agent.events.lost")
        missing = [k for k, *_ in sent if k not in set(right)]
        wrong = {k: found.get(k) for k in missing[:3]}
        pytest.fail(f"{len(right)} of {len(sent)} right spans; missing {[k[1] for k in missing[:10]]}; wrong {wrong}; "
                    f"rejected { {k: v for k, v in rej.items() if v} }; lost {lost}")


def rejected_now(agent, *reasons, at_least=1) -> dict:
    deadline = time.monotonic() + 30
    while True:
        rej = last_counter(jsonl_requests(agent.jsonl), "hostagent.agent.records.rejected")
        if sum(rej.get(r, 0) for r in reasons) >= at_least or time.monotonic() > deadline:
            return rej
        time.sleep(0.5)


def hostile(hostile_dir, cgroup, exe: str, *args: str) -> subprocess.Popen:
    p = as_hostile([str(hostile_dir / exe), str(hostile_dir / "hostile_http.py"), *args], cgroup,
                   stdout=subprocess.PIPE, text=True, cwd=str(hostile_dir))
    return p


def ready(p) -> int:
    line = p.stdout.readline().split()
    assert line and line[0] == "ready", line
    return int(line[1]) if len(line) > 1 else 0


def kill(*ps) -> None:
    for p in ps:
        p.kill()
    for p in ps:
        p.wait()


def test_files_named_like_nvidia_devices_make_no_gpu_process(run_agent, legit, hostile_dir, hostile_cgroup):
    """A process that maps plain files dev/nvidia0 and libcuda.so.1 is not a GPU process (device
    identity decides), so its 8,250 socketpairs holding request heads are never followed."""
    agent = run_agent(MCP_AGENT_PROCESS_WATCH="gpu", MCP_AGENT_PROCESS_PIDS=str(legit.pid))
    h = hostile(hostile_dir, hostile_cgroup, "hostile-srv", "spoof-socketpairs", "8250")
    try:
        assert ready(h) == 8250
        time.sleep(6)  # a full watch scan round
        sent = legit_round(legit.port, 0x51000)
        check_legit(agent, sent)
        assert not [a for v in http_spans(agent.jsonl).values() for a in v if int(a["process.pid"]) == h.pid]
    finally:
        kill(h)
    stop(agent)


def test_a_watched_hostile_process_holds_only_its_owners_share_of_connections(run_agent, legit, hostile_dir,
                                                                               hostile_cgroup):
    """Watched by name (process.comms, from its exec on), 8,250 socketpairs with a request in flight
    each, made at 2,000/s (slow enough that the agent reads every BEGIN: the pressure rule refuses
    faster ones, test_sixteen_watched_processes_flooding_request_records): its uid and cgroup hold
    requests.http_conns_per_owner (4,096) of the 16,384 connections."""
    agent = run_agent(MCP_AGENT_PROCESS_COMMS="hostile-srv", MCP_AGENT_PROCESS_PIDS=str(legit.pid))
    h = hostile(hostile_dir, hostile_cgroup, "hostile-srv", "spoof-socketpairs", "8250", "2000")
    try:
        assert ready(h) == 8250
        sent = legit_round(legit.port, 0x52000)
        check_legit(agent, sent)
        rej = rejected_now(agent, "http_uid_conns", "http_cgroup_conns", "http_pressure", at_least=8250 - 4096 - 16)
    finally:
        kill(h)
    # each connection past the share refused by it, or earlier by the pressure rule (an agent on 2
    # busy CPUs reads under 2,000 BEGINs/s): never more than the share held
    held = sum(rej.get(k, 0) for k in ("http_uid_conns", "http_cgroup_conns", "http_pressure"))
    assert held >= 8250 - 4096 - 16 and rej.get("http_uid_conns", 0) > 0, {k: v for k, v in rej.items() if v}
    print(f"share: {held:,} hostile connections refused; rejected { {k: v for k, v in rej.items() if v} }")
    stop(agent)


def test_slowloris_heads_that_never_end_take_no_connection_entry(run_agent, legit, hostile_dir, hostile_cgroup):
    """16,500 connections to the legitimate server, each with a head that never ends: a head still
    arriving waits in the LRU http_pend, never in the connection table, and pushes out only its like."""
    agent = run_agent(MCP_AGENT_PROCESS_PIDS=str(legit.pid))
    h = hostile(hostile_dir, hostile_cgroup, "hostile-srv", "slowloris", str(legit.port), "16500")
    try:
        n = ready(h)
        assert n >= 16000, n
        sent = legit_round(legit.port, 0x53000)
        check_legit(agent, sent)
    finally:
        kill(h)
    stop(agent)


def test_sixteen_watched_processes_flooding_request_records(run_agent, legit, hostile_dir, hostile_cgroup):
    """16 processes, watched by name, make and answer requests over socketpairs as fast as they can:
    their owners' begins per second and the pressure rule bound what enters http_events."""
    agent = run_agent(MCP_AGENT_PROCESS_COMMS="hostile-srv", MCP_AGENT_PROCESS_PIDS=str(legit.pid))
    hs = [hostile(hostile_dir, hostile_cgroup, "hostile-srv", "flood") for _ in range(16)]
    try:
        for h in hs:
            ready(h)
        time.sleep(2)
        sent = legit_round(legit.port, 0x54000)
        check_legit(agent, sent)
        rej = rejected_now(agent, "http_uid_rate", "http_cgroup_rate", "http_pressure")
    finally:
        kill(*hs)
    refused = sum(rej.get(k, 0) for k in ("http_uid_rate", "http_cgroup_rate", "http_pressure"))
    assert refused > 0, {k: v for k, v in rej.items() if v}
    print(f"flood: {refused:,} hostile requests refused; rejected { {k: v for k, v in rej.items() if v} }")
    stop(agent)


def duration_series(path) -> list[dict]:
    out = []
    for req in jsonl_requests(path):
        for rm in req.get("resourceMetrics", []):
            for sm in rm["scopeMetrics"]:
                for m in sm["metrics"]:
                    if m["name"] == "hostagent.request.duration":
                        for kind in ("histogram", "exponentialHistogram"):
                            for dp in m.get(kind, {}).get("dataPoints", []):
                                out.append({kv["key"]: next(iter(kv["value"].values())) for kv in dp.get("attributes", [])}
                                           | {"count": int(dp["count"])})
    return out


def test_another_users_binary_of_the_same_name_never_shares_the_latency_series(run_agent, hostile_dir,
                                                                                hostile_cgroup, tmp_path):
    """The legitimate server runs as `vllm`; so does the hostile user's server. Both are watched (by
    name); hostagent.request.duration keeps them apart by process.owner."""
    d = tmp_path / "bin"
    d.mkdir()
    shutil.copy(rs.go_binary(), d / "vllm")
    port = rs.free_port()
    srv = subprocess.Popen([str(d / "vllm"), str(port)])
    hport = rs.free_port()
    h = as_hostile([str(hostile_dir / "vllm"), "-m", "http.server", "--bind", "127.0.0.1", str(hport)],
                   hostile_cgroup, cwd=str(hostile_dir), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for p in (port, hport):
            deadline = time.monotonic() + 20
            while True:
                try:
                    rc.request(p, rc.build_request("GET", "/"))
                    break
                except OSError:
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
        agent = run_agent(MCP_AGENT_PROCESS_COMMS="vllm")
        deadline = time.monotonic() + 60  # both found by the watch scan (a round every 5 s; longer when busy)
        while True:
            rc.request(port, rc.build_request("GET", "/fast"))
            rc.request(hport, rc.build_request("GET", "/"))
            pids = {int(a["process.pid"]) for v in http_spans_all(agent.jsonl) for a in v}
            if {srv.pid, h.pid} <= pids or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert {srv.pid, h.pid} <= pids, pids
        for i in range(30):
            rc.request(port, rc.build_request("GET", "/fast"))
            rc.request(hport, rc.build_request("GET", "/"))
        deadline = time.monotonic() + 30
        while True:
            series = [s for s in duration_series(agent.jsonl) if s.get("process.executable.name") == "vllm"]
            owners = {s.get("process.owner") for s in series}
            if len(owners) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert "root" in owners and len(owners) == 2, series
        by_owner = {}
        for s in series:
            by_owner[s["process.owner"]] = max(by_owner.get(s["process.owner"], 0), s["count"])
        assert all(n >= 30 for n in by_owner.values()), by_owner
        stop(agent)
    finally:
        srv.kill()
        srv.wait()
        kill(h)


def test_the_agents_own_endpoints_are_never_traced(run_agent):
    """process.watch = all: every process's HTTP is followed, the agent's own /metrics scrapes not (the
    kernel never watches the agent's tgid, self_tgid)."""
    import urllib.request

    port = rs.free_port()
    agent = run_agent(MCP_AGENT_PROCESS_WATCH="all", MCP_AGENT_EXPORT_PROMETHEUS_LISTEN=f"127.0.0.1:{port}")
    for _ in range(10):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.status == 200 and r.read()
    time.sleep(3)
    mine = [a for req in jsonl_requests(agent.jsonl) for rsp in req.get("resourceSpans", [])
            for ss in rsp["scopeSpans"] for s in ss["spans"]
            for a in [{kv["key"]: next(iter(kv["value"].values())) for kv in s.get("attributes", [])}]
            if a.get("hostagent.request.source") == "http" and int(a.get("process.pid", -1)) == agent.p.pid]
    assert not mine, mine[:2]
    stop(agent)
