"""CUDA -> telemetry: zero-touch GPU step spans and the governor, ioctl and latency metrics."""

from __future__ import annotations

from ..requests.telemetry import counter_attributes
from ..telemetry.spec import Instrument, SpanSpec

STEP_SPAN = "mcp.gpu_step"
GOVERNOR_FIELDS = ("budget", "cost_ns", "duty", "unsteered", "launch_rate_hz", "attached_overhead", "overhead")

INSTRUMENTS = (
    Instrument("mcp.cuda.governor", "gauge", "",
               "launch-probe governor: budget, measured per-hit cost, duty cycle, estimated overhead"),
    Instrument("mcp.nvidia.ioctls", "counter", "", "ioctls on NVIDIA device files by request code"),
    Instrument("mcp.nvidia.ioctl_ns", "counter", "ns"),
    Instrument("mcp.cuda.latency", "counter", "",
               "latency of ctx switches, syncs, allocs, frees, NVIDIA ioctls: log2 buckets"),
)


def step_span(step, proc_attrs: dict) -> SpanSpec:
    """Zero-touch mode: one GPU step (launches since the thread's previous sync, closed by a sync)
    of a process that marks no requests, as a root span."""
    attrs = dict(proc_attrs)
    attrs.update({"thread.id": step.hdr.tid, "mcp.gpu_step.sync_kind": step.sync_kind,
                  "mcp.gpu_step.sync_ns": step.sync_ns})
    attrs.update(counter_attributes(step.counters))
    return SpanSpec(STEP_SPAN, step.begin_ns, max(step.hdr.ts_ns, step.begin_ns), attrs)


def rows(governor: dict, ioctls: list[dict], hists: list[dict]) -> dict:
    def ioctl_attrs(r):
        return {"process.pid": r["pid"], "mcp.nvidia.device": r["device"], "mcp.nvidia.ioctl.cmd": r["cmd"]}

    return {
        "mcp.cuda.governor": [(governor[k], {"mcp.governor.field": k}) for k in GOVERNOR_FIELDS
                              if governor.get(k) is not None],
        "mcp.nvidia.ioctls": [(r["count"], ioctl_attrs(r)) for r in ioctls],
        "mcp.nvidia.ioctl_ns": [(r["ns"], ioctl_attrs(r)) for r in ioctls],
        "mcp.cuda.latency": [(r["count"], {"process.pid": r["pid"], "mcp.cuda.kind": r["kind"],
                                           "mcp.latency.le_ns": r["le_ns"]}) for r in hists],
    }
