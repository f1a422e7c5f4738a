"""Shared fixtures. BPF tests need root, bcc, tracefs and kernel headers; CI must have them all:
when CI=true a missing facility fails the BPF tests instead of skipping them."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI") == "true"

# Tests live beside their capability (tests/requests/, tests/cuda/, ...) and share helpers across
# folders (the marked child, the stand-in libcuda's driver, the real CLI's agent): every folder is
# importable by module name, whatever the collection order.
sys.path[:0] = [str(d) for d in sorted(Path(__file__).parent.iterdir())
                if d.is_dir() and any(d.glob("test_*.py")) and str(d) not in sys.path]


def wait_port(port: int, proc=None, timeout: float = 30.0) -> None:
    """Until 127.0.0.1:port accepts a connection; fails if proc (a Popen) exits first or the time passes."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            import socket

            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on port {port} after {timeout} s"
            assert proc is None or proc.poll() is None, f"the server exited ({proc.returncode})"
            time.sleep(0.1)


def bpf_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (BPF, tracefs)"
    try:
        import bcc  # noqa: F401
    except ImportError as e:
        return f"bcc not importable ({e}); run scripts/setup.sh"
    from mcp_hostagent.core import kernel

    try:
        kernel.ensure_tracefs()
        kernel.find_kernel_headers()
    except kernel.KernelSetupError as e:
        return str(e)
    return None


def pytest_collection_modifyitems(config, items):
    reason = bpf_unavailable_reason() if any("bpf" in i.keywords for i in items) else None
    if reason is None or IN_CI:
        return  # in CI, let them run and fail loudly
    for item in items:
        if "bpf" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=f"BPF unavailable here: {reason}"))


# The identity of an observed process (process.*, container.*, k8s.pod.uid, hostagent.cgroup.path) is
# the RESOURCE of its request and GPU step spans (agent/telemetry/otel.py: a tracer provider per
# process); of it, the span's own attributes keep process.pid and thread.id only.
PROCESS_IDENTITY = ("process.executable.name", "process.command_line", "process.owner", "process.creation.time",
                    "container.id", "container.runtime", "k8s.pod.uid", "hostagent.cgroup.path")


def resource_attrs(span) -> dict:
    """An SDK ReadableSpan's resource attributes: the agent's own (service.*, host.name) merged with the
    observed process's identity."""
    return dict(span.resource.attributes)


def identity_on_resource_only(span) -> dict:
    """The span's process identity, read from its resource, after checking none of it leaked onto the
    span's attributes and that the resource describes the process the span names (process.pid)."""
    res = resource_attrs(span)
    leaked = [k for k in PROCESS_IDENTITY if k in span.attributes]
    assert not leaked, f"process identity on the span's attributes, not its resource: {leaked}"
    if "process.pid" in res:
        assert res["process.pid"] == span.attributes["process.pid"], (res, dict(span.attributes))
    return res


class RunningAgent:
    """An Agent running its loop on a thread, exporting spans to memory."""

    def __init__(self, overrides: dict, capabilities=None, **agent_kwargs):
        """capabilities: the Declarations to run instead of the registry's (a test's own beside them)."""
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from mcp_hostagent.config import load_config
        from mcp_hostagent.exporters import Exporters
        from mcp_hostagent.exporters.counting import CountingSpanExporter, ExportStats
        from mcp_hostagent.registry import make_agent as Agent

        base = {"export.jsonl_path": "", "status.enabled": False, "process.watch": "marked",
                "status.interval_s": 0.2}
        base.update(overrides)
        self.cfg = load_config(None, env={}, overrides=base)
        self.memory = InMemorySpanExporter()
        stats = ExportStats()
        exporters = Exporters(CountingSpanExporter(self.memory, stats), [], stats)
        if capabilities is None:
            self.agent = Agent(self.cfg, exporters=exporters, **agent_kwargs)
        else:
            from mcp_hostagent.core.agent import Agent as CoreAgent

            self.agent = CoreAgent(self.cfg, capabilities, exporters=exporters, **agent_kwargs)
        self.report = self.agent.start()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.agent.run, args=(self._stop,), daemon=True)
        self._thread.start()

    def spans(self, **attrs):
        self.agent.telemetry.tracer_provider.force_flush(2000)
        out = []
        for s in self.memory.get_finished_spans():
            if all(s.attributes.get(k) == v for k, v in attrs.items()):
                out.append(s)
        return out

    def wait_spans(self, n: int = 1, timeout: float = 10.0, **attrs):
        deadline = time.monotonic() + timeout
        while True:
            found = self.spans(**attrs)
            if len(found) >= n or time.monotonic() > deadline:
                return found
            time.sleep(0.1)

    def kernel_stat(self, name: str) -> int:
        self.agent._read_maps()
        return self.agent.health.kernel_stats.get(name, 0)

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.agent.stop()


@pytest.fixture(scope="module")
def agent():
    # Per module, not per session: a shared agent left running sees every later test's workload
    # (storms, libraries, log lines) and its memory and threads count as those tests' own.
    a = RunningAgent({})
    yield a
    a.close()


@pytest.fixture
def make_agent():
    made = []

    def make(agent_kwargs=None, **overrides):
        a = RunningAgent({k.replace("__", "."): v for k, v in overrides.items()}, **(agent_kwargs or {}))
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


def unstarted_agent(overrides: dict | None = None, **options):
    """The registry's capabilities made and wired as `run` makes them, never started: no BPF, no
    exporters; records handed to it (Agent._on_event) are decoded and handled as the ring buffer's."""
    from mcp_hostagent.config import load_config
    from mcp_hostagent.registry import make_agent

    base = {"export.jsonl_path": "", "nic.enabled": False}
    base.update(overrides or {})
    options.setdefault("nvml_module", object())
    return make_agent(load_config(None, env={}, overrides=base), **options)
