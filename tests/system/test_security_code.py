"""Issue 11, code execution and steering: a hostile unprivileged user (uid 4242) plants libcuda.so files
for the real `mcp-agent run` (process.watch = gpu) to find in its processes' maps.

- A libcuda.so the user owns, whose constructor leaves a file saying which uid ran it: before, the
  governor's calibration dlopen()ed it in a child of the agent and it ran as root. Now no file named
  libcuda is ever loaded by the agent; one a user could have written is refused, shown in
  `mcp-agent probes` with its reason, and counted (hostagent.agent.records.rejected, libcuda_refused).
- 150 root-owned copies mapped by one process: each followed file costs perf-event fds, and 150 ran
  the agent out of them (EMFILE killed it). cuda.max_libraries (16) follows the first and counts the rest.
- A trusted library called in a tight loop by a process with no NVIDIA device open: it drove the
  host-wide launch duty cycle to 1/53 for every GPU process. Only processes that use a GPU steer it.

Each: the legitimate process still gets >= 99 % of its spans with its /proc fault counts, the agent is
alive and stops within 5 s."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import time

import pytest

from test_cli import AGENT, clean_env
from test_reliability import jsonl_requests, last_counter
from test_security_blinding import (HOSTILE_UID, N_LEGIT, as_hostile, check_legit, child, hostile_bin,  # noqa: F401
                                    hostile_cgroup, legit_requests, rejected, run_agent, stop)

pytestmark = pytest.mark.bpf

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = {"MCP_AGENT_PROCESS_WATCH": "gpu"}


def _cc(out: str, *srcs: str) -> None:
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-fno-ipa-icf", "-o", out,
                    *(os.path.join(HERE, "c", s) for s in srcs), "-lpthread"], check=True)


def _reachable(path: str) -> None:
    """uid 4242 can reach path through every parent (pytest's tmp directories are root's, 0700)."""
    p = os.path.dirname(path)
    while p != "/":
        os.chmod(p, os.stat(p).st_mode | 0o711)
        p = os.path.dirname(p)


@pytest.fixture
def planted(tmp_path):
    """A libcuda.so.1 (fake driver + constructor) in a directory owned by uid 4242, the file theirs too."""
    d = tmp_path / "home-4242"
    d.mkdir()
    lib = str(d / "libcuda.so.1")
    _cc(lib, "fake_libcuda.c", "evil_ctor.c")
    os.chown(d, HOSTILE_UID, HOSTILE_UID)
    os.chown(lib, HOSTILE_UID, HOSTILE_UID)
    _reachable(lib)
    return lib


def metric_points(reqs: list[dict], name: str, key: str) -> dict[str, float]:
    """The last value of a gauge or counter in OTLP-JSON metric requests, by the attribute `key`."""
    out = {}
    for req in reqs:
        for rm in req.get("resourceMetrics", []):
            for sm in rm["scopeMetrics"]:
                for m in sm["metrics"]:
                    if m["name"] != name:
                        continue
                    for dp in (m.get("gauge") or m.get("sum"))["dataPoints"]:
                        a = {kv["key"]: kv["value"]["stringValue"] for kv in dp.get("attributes", [])}
                        out[a.get(key, "")] = dp["asDouble"] if "asDouble" in dp else int(dp["asInt"])
    return out


def wait_metric(agent, fn, timeout: float = 60.0):
    """fn(OTLP-JSON requests) until it is truthy, else its last value after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        got = fn(jsonl_requests(agent.jsonl))
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def test_user_owned_libcuda_is_never_loaded(run_agent, hostile_bin, hostile_cgroup, child, planted):
    agent = run_agent(**GPU)
    h = as_hostile([hostile_bin, "launch", "30", planted], hostile_cgroup, stdout=subprocess.PIPE, text=True)
    try:
        # its constructor ran in the hostile process (as 4242): the library is live and mapped
        deadline = time.monotonic() + 10
        while not os.path.exists(f"{planted}.ran-as-{HOSTILE_UID}"):
            assert time.monotonic() < deadline and h.poll() is None, "the planted library did not load"
            time.sleep(0.05)
        refused = wait_metric(agent, lambda reqs: last_counter(reqs, "hostagent.agent.records.rejected")
                              .get("libcuda_refused", 0))
        assert refused >= 1, agent.stderr[-2000:]
        want = legit_requests(child, 0x5000)
        check_legit(agent, child, want, 20)
        p = subprocess.run([*AGENT, "probes"], env=clean_env(**GPU), capture_output=True, text=True, timeout=180)
    finally:
        h.kill()
        h.wait()
    ran = sorted(os.path.basename(f) for f in glob.glob(f"{planted}.ran-as-*"))
    assert ran == [f"libcuda.so.1.ran-as-{HOSTILE_UID}"], f"the planted library ran as: {ran}"
    line = next((ln for ln in p.stdout.splitlines() if planted in ln), None)
    assert line and "refused" in line and f"owned by uid {HOSTILE_UID}" in line, p.stdout + p.stderr
    stop(agent)


def test_libraries_beyond_the_cap_are_counted_not_followed(run_agent, hostile_bin, hostile_cgroup, child, tmp_path):
    """150 root-owned copies in a 0755 root directory (trusted), mapped by one hostile process."""
    d = tmp_path / "libs"
    d.mkdir()
    _cc(str(tmp_path / "libcuda.so.1"), "fake_libcuda.c")
    libs = []
    for i in range(150):
        os.mkdir(d / f"{i:03d}")
        libs.append(str(d / f"{i:03d}" / "libcuda.so.1"))
        shutil.copy(tmp_path / "libcuda.so.1", libs[-1])  # each its own inode
    _reachable(libs[0])
    agent = run_agent(**GPU)
    h = as_hostile([hostile_bin, "libs", "0", *libs], hostile_cgroup, stdin=subprocess.PIPE,
                   stdout=subprocess.PIPE, text=True)
    try:
        assert h.stdout.readline().strip() == "ready"
        refused = wait_metric(agent, lambda reqs: last_counter(reqs, "hostagent.agent.records.rejected")
                              .get("libcuda_refused", 0) >= 150 - 16 and reqs, timeout=90)
        rej = last_counter(jsonl_requests(agent.jsonl), "hostagent.agent.records.rejected")
        assert refused and rej.get("libcuda_refused") == 150 - 16, rej
        fds = len(os.listdir(f"/proc/{agent.p.pid}/fd"))
        print(f"150 libraries mapped: 16 followed, {rej['libcuda_refused']} refused; the agent holds {fds} fds")
        want = legit_requests(child, 0x6000)
        check_legit(agent, child, want, 20)
    finally:
        h.kill()
        h.wait()
    stop(agent)


def test_a_process_without_a_gpu_does_not_steer_the_governor(run_agent, hostile_bin, hostile_cgroup, child, tmp_path):
    """A root-owned (trusted) fake libcuda called ~10^5-10^6 times a second by a process with no NVIDIA
    device open: the governor does not duty-cycle anyone for it (duty stays 1) and reports it unsteered.
    (test_bpf_cuda's duty-cycle test shows the same loop in a GPU user does steer it.)"""
    d = tmp_path / "lib"
    d.mkdir()
    lib = str(d / "libcuda.so.1")
    _cc(lib, "fake_libcuda.c")
    _reachable(lib)
    agent = run_agent(**GPU)
    h = as_hostile([hostile_bin, "launch", "40", lib], hostile_cgroup, stdout=subprocess.PIPE, text=True)
    try:
        gov = wait_metric(agent, lambda reqs: (lambda g: g if g.get("unsteered", 0) >= 1 else None)(
            metric_points(reqs, "hostagent.cuda.governor", "hostagent.governor.field")), timeout=60)
        assert gov, metric_points(jsonl_requests(agent.jsonl), "hostagent.cuda.governor", "hostagent.governor.field")
        time.sleep(8)  # several control windows with the loop running
        gov = metric_points(jsonl_requests(agent.jsonl), "hostagent.cuda.governor", "hostagent.governor.field")
        print(f"governor while a non-GPU process launches: {gov}")
        assert gov["duty"] == 1.0 and gov["unsteered"] >= 1, gov
        want = legit_requests(child, 0x7000)
        check_legit(agent, child, want, 20)
    finally:
        h.kill()
        h.wait()
    stop(agent)
