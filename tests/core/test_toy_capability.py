"""A capability added by one line: tests/core/toy/ holds all of it (its BPF source with one
tracepoint, its header with one record, the record's mirror and route, one request span attribute),
and the agent runs it beside the registry's as Agent(cfg, CAPABILITIES + (toy.CAPABILITY,)), no file
of the agent touched. Real BPF: a marked child calls getppid() inside and outside a request, and the
request's span says exactly how many it made inside."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import subprocess
import sys

import pytest

from conftest import RunningAgent

sys.path.insert(0, os.path.dirname(__file__))
import toy  # noqa: E402

from mcp_hostagent.core.records import parse_constants  # noqa: E402
from mcp_hostagent.core.unit import Unit, UnitError  # noqa: E402
from mcp_hostagent.registry import CAPABILITIES  # noqa: E402

CHILD = """
import os, sys
from mcp_hostagent.marker import request
n = int(sys.argv[1])
for _ in range(7):
    os.getppid()  # outside any request: the kernel side sends nothing
with request(request_id=0x70A):
    for _ in range(n):
        os.getppid()
for _ in range(7):
    os.getppid()
"""


def test_the_toy_unit_is_the_registrys_plus_its_folder():
    base, unit = Unit(CAPABILITIES), Unit(CAPABILITIES + (toy.CAPABILITY,))
    assert unit.sources()[:-1] == base.sources() and unit.sources()[-1] == ("toy.bpf.c", toy.CAPABILITY.bpf)
    assert os.path.dirname(toy.CAPABILITY.bpf) in unit.include_dirs()
    assert unit.constants()["MCP_EV_TOY_GETPPID"] == toy.C["MCP_EV_TOY_GETPPID"]
    assert [p.name for p in unit.probes] == [p.name for p in base.probes] + ["toy_getppid"]
    # its record's number is its own: no family of the registry's uses it
    numbers = {v for k, v in base.constants().items() if k.startswith("MCP_EV_")}
    assert toy.C["MCP_EV_TOY_GETPPID"] not in numbers


def test_a_second_claim_on_a_probe_or_a_raw_kind_is_refused_when_the_unit_is_made():
    """One program per probe name and one decoder per raw tracepoint kind: a capability that claims
    another's is an error at once, never a silent override by registry order."""
    oom_kind = next(k for d in CAPABILITIES for k in d.raw if d.name == "reclaim")
    twin = dataclasses.replace(toy.CAPABILITY, name="twin", probes=(), raw={oom_kind: toy.CAPABILITY})
    with pytest.raises(UnitError, match=f"raw tracepoint kind {oom_kind} declared by both reclaim and twin"):
        Unit(CAPABILITIES + (twin,))
    with pytest.raises(UnitError, match="probe 'toy_getppid' declared by both toy and twin"):
        Unit(CAPABILITIES + (toy.CAPABILITY, dataclasses.replace(toy.CAPABILITY, name="twin")))


def test_the_toy_records_mirror_is_its_header():
    text = open(os.path.join(toy.HERE, "toy.h")).read()
    assert parse_constants(text)["MCP_EV_TOY_GETPPID"] == 90
    assert ctypes.sizeof(toy.EvToy) == ctypes.sizeof(toy.Hdr) + 8


@pytest.mark.bpf
def test_a_toy_capability_counts_its_own_events_into_the_request_span():
    a = RunningAgent({}, capabilities=CAPABILITIES + (toy.CAPABILITY,))
    try:
        st = a.report.plan.statuses["toy_getppid"]
        assert st.state == "attached", (st.state, st.reason)
        n = 321
        r = subprocess.run([sys.executable, "-c", CHILD, str(n)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        (span,) = a.wait_spans(1, **{"hostagent.request.id": f"{0x70A:016x}"})
        assert span.attributes[toy.CALLS] == n  # only the calls inside the request, each once
        assert "hostagent.faults.user" in span.attributes  # the registry's capabilities as before
        assert a.agent.health.rejected.get("evidence_undeclared", 0) == 0
    finally:
        a.close()
