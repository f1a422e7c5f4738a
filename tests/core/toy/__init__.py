"""A capability made only of its own folder (tests/core/test_toy_capability.py): its BPF source and
header, its record's mirror and route, one request span attribute. The agent runs it beside the
registry's by one line: Agent(cfg, CAPABILITIES + (CAPABILITY,))."""

from __future__ import annotations

import ctypes
import os
from collections import Counter

from mcp_hostagent.core.capability import Capability, Declaration, Evidence
from mcp_hostagent.core.decode import Route
from mcp_hostagent.core.probes import ProbeSpec
from mcp_hostagent.core.records import Hdr, header_constants, u64

HERE = os.path.dirname(os.path.abspath(__file__))
C = header_constants("toy.h", directory=HERE)
CALLS = "hostagent.toy.getppid.calls"


class EvToy(ctypes.Structure):
    _fields_ = [("h", Hdr), ("request_id", u64)]


class Toy(Capability):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.calls: Counter = Counter()  # (tgid, tid, request id) -> getppid() calls in it

    def routes(self) -> dict:
        return {C["MCP_EV_TOY_GETPPID"]: Route(EvToy, lambda rec, hdr: (hdr, rec.request_id), (self.on_call,))}

    def on_call(self, rec) -> None:
        hdr, request_id = rec
        self.calls[(hdr.tgid, hdr.tid, request_id)] += 1

    def evidence(self, fr) -> Evidence:
        n = self.calls.pop((fr.tgid, fr.tid, fr.request_id), 0)
        return Evidence({CALLS: n}) if n else Evidence()


CAPABILITY = Declaration(
    name="toy", make=lambda: Toy, bpf=os.path.join(HERE, "toy.bpf.c"), header="toy.h",
    structs={"mcp_ev_toy": EvToy}, attributes=(CALLS,),
    probes=(ProbeSpec("toy_getppid", "syscalls:sys_enter_getppid", "toy.bpf.c",
                      "getppid() calls inside a request (a test's capability)", "needs syscall tracepoints"),),
)
