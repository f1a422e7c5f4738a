"""The libcuda uprobe families' states on the real kernel, with the stand-in libcuda (tests/c/fake_libcuda.c)
mapped by tests/c/cuda_driver.c: `mcp-agent probes` finds its symbols but attaches nothing, so the
families read `found`, never `attached`; a running agent reads them `waiting` until a process maps the
library, then `armed` (the probe table, the status line's count and the probe-state gauge alike)."""

from __future__ import annotations

import os
import time

import pytest

from test_bpf_cuda import Driver, build  # noqa: F401  (build: the module-scoped fixture)
from test_cli import cli

pytestmark = pytest.mark.bpf


def uprobe_rows():
    from mcp_hostagent.cuda.symbols import UPROBE_ROWS

    return UPROBE_ROWS


def others_map_libcuda() -> bool:
    """Does any process here map a libcuda.so now (another session's test, a real driver)?"""
    from mcp_hostagent.cuda.finder import libcuda_mappings

    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                if libcuda_mappings(f.read()):
                    return True
        except OSError:
            continue
    return False


def test_probes_command_finds_the_library_and_attaches_nothing(build):
    d = Driver(build, build.lib)
    try:
        r = cli("probes", timeout=180)
    finally:
        d.close()
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    out = r.stdout.splitlines()
    head = next(i for i, ln in enumerate(out) if ln.split()[:3] == ["PROBE", "HOOK", "STATE"])
    table = {ln.split()[0]: ln for ln in out[head + 1:out.index("", head)]}
    for row in uprobe_rows():
        state = table[row].split()[2]
        assert state == "found", table[row]
        assert "not attached by `mcp-agent probes`" in table[row], table[row]
    mine = [ln.split() for ln in out if ln.startswith(build.lib + " ")]
    assert mine and {ln[2] for ln in mine} == {"found"}, r.stdout


def test_run_reads_waiting_then_armed(make_agent, build):
    ra = make_agent(process__watch="gpu")
    plan, health = ra.agent.plan, ra.agent.health
    live0 = plan.live()
    if not others_map_libcuda():
        assert {plan.statuses[r].state for r in uprobe_rows()} == {"waiting"}, plan.statuses
        assert ra.agent.status_line().startswith(f"probes {live0}/{len(plan.statuses)} ")
        assert live0 == plan.counts()["attached"]
    d = Driver(build, build.lib)
    try:
        deadline = time.monotonic() + 15  # the exec follow-up rereads its maps at 0.05, 0.3, 1, 3, 10 s
        while {plan.statuses[r].state for r in uprobe_rows()} != {"armed"} and time.monotonic() < deadline:
            time.sleep(0.1)
        states = {r: (plan.statuses[r].state, plan.statuses[r].reason) for r in uprobe_rows()}
        assert {s for s, _ in states.values()} == {"armed"}, states
        assert all(why.startswith("armed in ") for _, why in states.values()), states
        assert plan.live() == plan.counts()["attached"] + len(uprobe_rows())
        deadline = time.monotonic() + 5  # the next tick: the probe-state gauge's copy follows
        while {health.probes[r] for r in uprobe_rows()} != {"armed"} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert {health.probes[r] for r in uprobe_rows()} == {"armed"}, health.probes
    finally:
        d.close()
