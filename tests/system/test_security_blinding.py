"""Issue 11, blinding: a hostile unprivileged user (uid 4242, in a cgroup of its own, as a login
session's scope is) attacks the request maps and the ring buffer of the real `mcp-agent run`, while a
legitimate process (root, in the test's cgroup) marks 100 requests whose page faults are checked
against its /proc/PID/stat. Each attack: the legitimate process gets >= 99 spans with the right
counts, the agent stays alive and stops within 5 s of SIGTERM, and the refusals are in
hostagent.agent.records.rejected.

Measured before the owner budgets (one ring buffer, per-process bounds only): 0 of 100 spans under
(a) and (b) and (c), 77 of 100 with one flooding process."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from test_bpf_requests import TP, Child
from test_reliability import Agent, jsonl_requests, last_counter

pytestmark = pytest.mark.bpf

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTILE_UID = 4242
N_LEGIT = 100


def as_hostile(cmd: list[str], cgroup: str, **kw) -> subprocess.Popen:
    """cmd as uid/gid 4242, no groups, in `cgroup` (a cgroup v2 directory): moved there before the
    exec, while still root."""
    return subprocess.Popen(["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', cgroup,
                             "setpriv", f"--reuid={HOSTILE_UID}", f"--regid={HOSTILE_UID}", "--clear-groups",
                             *cmd], **kw)


@pytest.fixture(scope="module")
def hostile_bin(tmp_path_factory):
    """tests/c/hostile.c in a directory the hostile uid can enter (pytest's tmp is root's, 0700)."""
    from mcp_hostagent.core.records import bpf_source_dir

    d = tmp_path_factory.mktemp("hostile")
    os.chmod(d, 0o755)
    out = str(d / "hostile")
    subprocess.run(["cc", "-O2", "-Wall", "-Werror", f"-I{bpf_source_dir()}", "-o", out,
                    os.path.join(HERE, "c", "hostile.c"), "-ldl", "-lpthread"], check=True)
    os.chmod(out, 0o755)
    reachable(d)
    return out


def reachable(path) -> None:
    """Every directory above path searchable by anyone: the hostile uid must reach what it runs."""
    p = os.path.dirname(str(path))
    while p != "/":
        os.chmod(p, os.stat(p).st_mode | 0o711)
        p = os.path.dirname(p)


@pytest.fixture
def hostile_cgroup():
    from mcp_hostagent.requests.owners import cgroup2_root

    root = cgroup2_root()
    assert root, "no cgroup v2 hierarchy: the cgroup budget cannot be tested"
    path = os.path.join(root, f"mcp-test-hostile-{os.getpid()}-{time.monotonic_ns()}")
    os.mkdir(path)
    yield path
    for _ in range(100):  # its processes are killed by the test; wait for them to leave
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                for pid in f.read().split():
                    try:
                        os.kill(int(pid), 9)
                    except ProcessLookupError:
                        pass
            os.rmdir(path)
            break
        except OSError:
            time.sleep(0.1)


@pytest.fixture
def run_agent(tmp_path):
    made = []

    def start(**env):
        jsonl = tmp_path / "telemetry.jsonl"
        a = Agent(tmp_path, env={"MCP_AGENT_EXPORT_JSONL_PATH": str(jsonl), "MCP_AGENT_EXPORT_METRIC_INTERVAL_S": "1",
                                 "MCP_AGENT_PROCESS_WATCH": "marked", "MCP_AGENT_GPU_ENABLED": "false",
                                 "MCP_AGENT_NIC_ENABLED": "false", **env})
        a.jsonl = jsonl
        made.append(a)
        a.ready(timeout=90)
        return a

    yield start
    for a in made:
        a.close()


def legit_requests(child: Child, base: int, n: int = N_LEGIT, pages: int = 20) -> dict[str, int]:
    """n requests, each first-touching `pages` pages: request id (hex, as on the span) -> the
    process's minflt+majflt delta over it, read from /proc while it waits on stdin."""
    want = {}
    for i in range(n):
        rid = base + i
        f0 = sum(child.stat_faults())
        child.do(f"begin {rid} {TP}", f"touch {pages}", f"end {rid}")
        want[f"{rid:016x}"] = sum(child.stat_faults()) - f0
    return want


def spans_of(reqs: list[dict], pid: int) -> dict[str, dict]:
    out = {}
    for req in reqs:
        for rs in req.get("resourceSpans", []):
            for ss in rs["scopeSpans"]:
                for s in ss["spans"]:
                    a = {kv["key"]: next(iter(kv["value"].values())) for kv in s.get("attributes", [])}
                    if int(a.get("process.pid", -1)) == pid and "hostagent.request.id" in a:
                        out[a["hostagent.request.id"]] = a
    return out


def check_legit(agent, child: Child, want: dict[str, int], pages: int) -> None:
    """>= 99% of the legitimate spans, each with its page faults (the /proc delta, within its tolerance:
    the interpreter's work around the markers)."""
    deadline = time.monotonic() + 20
    while True:
        got = spans_of(jsonl_requests(agent.jsonl), child.pid)
        if len(got) >= len(want) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    missing = sorted(set(want) - set(got))
    print(f"legit: {len(want) - len(missing)} of {len(want)} spans; missing {missing[:5]}")
    assert len(missing) <= 0.01 * len(want), f"{len(got)} of {len(want)} spans\n{agent.stderr[-2000:]}"
    bad = {rid: (int(got[rid]["hostagent.faults.user"]), want[rid]) for rid in set(got) & set(want)
           if not (int(got[rid]["hostagent.faults.user"]) >= pages
                   and abs(int(got[rid]["hostagent.faults.user"]) - want[rid]) <= 5)}
    assert not bad, f"faults (span, /proc) differ: {dict(list(bad.items())[:5])}"


def rejected(agent, *reasons: str, at_least: int = 1) -> dict[str, int]:
    """hostagent.agent.records.rejected by reason, from the metrics the agent wrote: the first export whose
    `reasons` add up to at_least (a starved agent exports late), else the last within 30 s."""
    deadline = time.monotonic() + 30
    while True:
        rej = last_counter(jsonl_requests(agent.jsonl), "hostagent.agent.records.rejected")
        if sum(rej.get(r, 0) for r in reasons) >= at_least or time.monotonic() > deadline:
            return rej
        time.sleep(0.5)


def stop(agent) -> None:
    assert agent.p.poll() is None, f"the agent died:\n{agent.stderr[-3000:]}"
    rc, took = agent.term(5.0)
    assert rc == 0 and took <= 5.0 and "Traceback" not in agent.stderr, (rc, took, agent.stderr[-3000:])


@pytest.fixture
def child():
    c = Child()
    c.do("spin 1")
    yield c
    c.close()


def test_marker_flood_by_200_processes(run_agent, hostile_bin, hostile_cgroup, child):
    """(a) 200 processes of one user mark begin+end as fast as they can: their uid's and cgroup's
    begin budgets (20,000/s each, as one process's) bound what reaches the ring buffer, which requests share with no
    bulk record; the legitimate process's requests all arrive."""
    agent = run_agent()
    flood = [as_hostile([hostile_bin, "flood", "25"], hostile_cgroup, stdout=subprocess.PIPE, text=True)
             for _ in range(200)]
    try:
        time.sleep(2)  # all of them marking
        want = legit_requests(child, 0x1000)
        during = len(spans_of(jsonl_requests(agent.jsonl), child.pid))
    finally:
        for p in flood:
            p.kill()
        for p in flood:
            p.wait()
    rej = rejected(agent, "begin_uid_rate", "begin_cgroup_rate")
    # 200 busy processes leave the agent a few % of 2 cores: spans come late, none is lost
    t0 = time.monotonic()
    check_legit(agent, child, want, 20)
    print(f"flood: {during} of {N_LEGIT} spans written while it lasted, the rest {time.monotonic() - t0:.1f} s after")
    refused = rej.get("begin_uid_rate", 0) + rej.get("begin_cgroup_rate", 0)
    assert refused > 0, rej
    print(f"flood: {refused:,} hostile begins refused over the owner budgets; rejected {rej}")
    stop(agent)


def test_4200_marking_processes(run_agent, hostile_bin, hostile_cgroup, child):
    """(b) 4,200 processes of one user each mark once and live on: tgid_state and watch_tgid (4,096
    entries) would be full; the uid's process budget (256) keeps them to a share."""
    agent = run_agent()
    h = as_hostile([hostile_bin, "procs", "4200"], hostile_cgroup, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                   text=True)
    try:
        assert h.stdout.readline().strip() == "ready"
        want = legit_requests(child, 0x2000)
        check_legit(agent, child, want, 20)
        rej = rejected(agent, "begin_uid_procs", "begin_cgroup_procs", at_least=4200 - 256)
    finally:
        h.kill()
        h.wait()
    assert rej.get("begin_uid_procs", 0) + rej.get("begin_cgroup_procs", 0) >= 4200 - 256, rej
    print(f"4,200 processes: rejected {rej}")
    stop(agent)


def test_17000_threads_holding_requests_open(run_agent, hostile_bin, hostile_cgroup, child):
    """(c) 17 processes of 1,000 threads each hold a request open: req_by_tid (16,384) would be full;
    the uid's open-request budget (2,048) keeps it to a share. The begin-rate budgets are raised, so
    that the open cap is what refuses them, however fast the threads start."""
    agent = run_agent(MCP_AGENT_REQUESTS_MAX_BEGINS_PER_S_PER_UID="10000000",
                      MCP_AGENT_REQUESTS_MAX_BEGINS_PER_S_PER_CGROUP="10000000")
    hs = [as_hostile([hostile_bin, "threads", "1000"], hostile_cgroup, stdin=subprocess.PIPE,
                     stdout=subprocess.PIPE, text=True) for _ in range(17)]
    try:
        for h in hs:
            assert h.stdout.readline().strip() == "ready"
        want = legit_requests(child, 0x3000)
        check_legit(agent, child, want, 20)
        rej = rejected(agent, "begin_uid_open", "begin_cgroup_open", "begin_pressure",
                       at_least=17000 - 2048 - (os.cpu_count() - 1))
        print(f"17,000 threads: rejected { {k: v for k, v in rej.items() if v} }")
    finally:
        for h in hs:
            h.kill()
        for h in hs:
            h.wait()
    # a burst of 17,000 begins also puts the agent's reader behind: the pressure rule then refuses
    # some of them first; either way the uid holds at most its 2,048, plus one per other CPU: the
    # budget is checked, then added to (mark_begin), so begins racing on every CPU can all pass the
    # check at 2,047 (seen once in a full run here: 14,951 held back)
    held_back = sum(rej.get(k, 0) for k in ("begin_uid_open", "begin_cgroup_open", "begin_pressure"))
    racing = os.cpu_count() - 1
    assert held_back >= 17000 - 2048 - racing and rej.get("begin_uid_open", 0) > 0, {k: v for k, v in rej.items() if v}
    stop(agent)


def test_allow_list_drops_other_markers_in_the_kernel(run_agent, hostile_bin, hostile_cgroup, child):
    """requests.mark_users = root: the hostile user's markers are counted and dropped before any map
    write; root's requests are exempt from the owner budgets."""
    agent = run_agent(MCP_AGENT_REQUESTS_MARK_USERS="root")
    flood = [as_hostile([hostile_bin, "flood", "20"], hostile_cgroup, stdout=subprocess.PIPE, text=True)
             for _ in range(20)]
    try:
        want = legit_requests(child, 0x4000)
        check_legit(agent, child, want, 20)
        rej = rejected(agent, "mark_denied", at_least=1001)
    finally:
        for p in flood:
            p.kill()
        for p in flood:
            p.wait()
    assert rej.get("mark_denied", 0) > 1000, rej
    assert not any(rej.get(k, 0) for k in ("begin_uid_rate", "begin_cgroup_rate", "rb_req_lost")), rej
    stop(agent)

