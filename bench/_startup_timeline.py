"""`mcp-agent` with a timeline of its start-up, for bench_startup.py's `timeline` kind.

    python bench/_startup_timeline.py OUT.json run --no-status ...

Unlike _startup_probe.py, which imports the pipeline before the CLI runs (so that it can wrap its
functions), this imports nothing ahead: an import hook times the imports named in IMPORTS in whatever
thread makes them, and wraps the functions in WRAP once their module has loaded. So the order and
overlap of a real `run` are kept: the compile thread, the imports behind it, the main thread. Each
event is (name, thread, start, end) in CLOCK_MONOTONIC ns, which the parent shares with its spawn time.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import json
import sys
import threading
import time

OUT = sys.argv.pop(1)
events: list[tuple[str, str, int, int]] = [("python start-up done", "MainThread", time.monotonic_ns(), 0)]

IMPORTS = {"mcp_hostagent.entry", "mcp_hostagent.cli", "mcp_hostagent.core.agent", "mcp_hostagent.core.loader", "bcc",
           "opentelemetry.sdk.trace", "opentelemetry.sdk.metrics", "google.protobuf", "psutil", "pynvml",
           "mcp_hostagent.exporters", "mcp_hostagent.cuda.capability", "mcp_hostagent.telemetry.otel",
           "pyroute2", "mcp_hostagent.control", "mcp_hostagent.sdnotify", "mcp_hostagent.exporters.files"}
# module -> [(owner attribute path, event name)]
WRAP = {
    "mcp_hostagent.core.loader": [("compile_ahead_for", "compile ahead: begin"), ("_compile", "compile line"),
                                  ("_from_cache", "the unit from the cache"), ("_load_all", "verify programs"),
                                  ("_take_ahead", "wait for the compile"), ("load", "loader.load")],
    "mcp_hostagent.core.bccglue": [("compile_quietly", "bcc compile"),
                                   ("release_compiler_memory", "release compiler memory")],
    "mcp_hostagent.core.mapset": [("make", "maps made")],
    "mcp_hostagent.core.compile_cache": [("get", "cache read")],
    "mcp_hostagent.core.agent": [("Agent.start", "Agent.start"), ("Agent.__init__", "Agent()")],
    "mcp_hostagent.cli": [("_start_agent", "cli: start the agent")],
    "mcp_hostagent.core.imports_behind": [("wait", "wait for the imports behind")],
    "mcp_hostagent.cuda.capability": [("CudaProbes.start", "cuda: start")],
    "mcp_hostagent.cuda.uprobes": [("UprobeAttacher.attach", "uprobe attach")],
    "mcp_hostagent.gpuhealth.capability": [("GpuHealth.start", "gpu health start")],
    "mcp_hostagent.sdnotify": [("Notifier.ready", "READY=1")],
}


def _record(name: str, t0: int) -> None:
    events.append((name, threading.current_thread().name, t0, time.monotonic_ns()))


def _wrap(owner, attr: str, name: str) -> None:
    fn = getattr(owner, attr, None)
    if fn is None:
        return

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        t0 = time.monotonic_ns()
        try:
            return fn(*a, **kw)
        finally:
            _record(name, t0)

    setattr(owner, attr, wrapper)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, name):
        self.inner, self.name = inner, name

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        t0 = time.monotonic_ns()
        try:
            self.inner.exec_module(module)
        finally:
            if self.name in IMPORTS:
                _record(f"import {self.name}", t0)
        for path, name in WRAP.get(self.name, ()):
            owner, _, attr = path.rpartition(".")
            _wrap(getattr(module, owner) if owner else module, attr, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in IMPORTS and name not in WRAP:
            return None
        for f in sys.meta_path:
            if f is self:
                continue
            spec = f.find_spec(name, path, target) if hasattr(f, "find_spec") else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, name)
                return spec
        return None


def _write() -> None:
    with open(OUT, "w") as f:
        json.dump({"events": events}, f)


atexit.register(_write)
sys.meta_path.insert(0, _Finder())

from mcp_hostagent import entry  # noqa: E402

sys.argv[0] = "mcp-agent"
entry.main()
