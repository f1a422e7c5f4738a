"""`mcp-agent` with a stopwatch on each start-up and shutdown step, for bench_startup.py.

    python bench/_startup_probe.py OUT.json run --no-status ...

Runs the entry point's main() in this process, as `mcp-agent` does, after
wrapping the functions that make up start-up and shutdown: each wrapper records (name, start, end)
in CLOCK_MONOTONIC ns, which the parent shares, so the steps line up with its spawn, READY=1,
SIGTERM and exit times. The record is written at exit, by the first atexit handler registered (so
it runs after the OTel SDK's own). The wrappers cost microseconds; the parent still takes its
headline numbers from runs of the plain entry point.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import json
import sys
import time

T_MAIN = time.monotonic_ns()  # interpreter and site start-up are done by now
OUT = sys.argv.pop(1)
spans: list[tuple[str, int, int]] = []
marks: list[tuple[str, int]] = [("main", T_MAIN)]


def _write() -> None:
    marks.append(("atexit", time.monotonic_ns()))
    with open(OUT, "w") as f:
        json.dump({"spans": spans, "marks": marks}, f)


atexit.register(_write)


def timed(owner, attr: str, name: str, once: bool = False) -> None:
    fn = getattr(owner, attr)
    done = []

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        if once and done:
            return fn(*a, **kw)
        done.append(1)
        t0 = time.monotonic_ns()
        try:
            return fn(*a, **kw)
        finally:
            spans.append((name, t0, time.monotonic_ns()))

    setattr(owner, attr, wrapper)


t0 = time.monotonic_ns()
from mcp_hostagent import entry  # noqa: E402,F401
from mcp_hostagent.core import bccglue, loader  # noqa: E402

importlib.import_module("mcp_hostagent.cli")  # click, config: what the entry point imports next

spans.append(("import cli (click, config)", t0, time.monotonic_ns()))
t0 = time.monotonic_ns()
from mcp_hostagent import control, exporters, sdnotify  # noqa: E402
from mcp_hostagent.core import agent  # noqa: E402
from mcp_hostagent.cuda.probeset import CudaProbes  # noqa: E402
from mcp_hostagent.gpuhealth.capability import GpuHealth  # noqa: E402
from mcp_hostagent.telemetry.otel import Telemetry  # noqa: E402

# the name bench_startup.py reads this step by (the pipeline is core.agent and the capabilities now)
spans.append(("import pipeline (OTel SDK, psutil, ...)", t0, time.monotonic_ns()))

timed(agent.Agent, "start", "Agent.start")
timed(agent, "prepare_kernel", "kernel: tracefs, headers")
timed(exporters, "from_config", "exporters: build")  # Agent.start calls exporters.from_config(cfg)
timed(loader, "load", "loader.load")
timed(bccglue, "bpf_class", "import bcc", once=True)
timed(loader, "_compile", "bcc/LLVM compile")  # run's compile: in a thread, begun ahead; both processes
timed(loader, "_take_ahead", "compile wait")
timed(CudaProbes, "start", "cuda: libcuda scan, calibration")
timed(Telemetry, "__init__", "telemetry: providers")
timed(GpuHealth, "start", "gpu health sources")
timed(agent.Agent, "tick", "first tick", once=True)
timed(control, "serve", "control socket")
timed(sdnotify.Notifier, "ready", "READY=1 sent", once=True)
timed(sdnotify.Notifier, "stopping", "STOPPING=1 sent")
timed(agent.Agent, "stop", "Agent.stop")
timed(agent.Agent, "detach", "detach (uprobes, tracepoints, bpf.cleanup)")
timed(GpuHealth, "stop", "gpu sources stop")
timed(Telemetry, "shutdown", "telemetry: flush, shutdown")
timed(control.ControlServer, "stop", "control socket stop")

sys.argv[0] = "mcp-agent"
try:
    entry.main()
finally:
    marks.append(("main returned", time.monotonic_ns()))
