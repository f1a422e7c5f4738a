"""CUDA -> telemetry: zero-touch GPU step spans and the governor, ioctl and latency metrics."""

from __future__ import annotations

from ..core.request import counter_attributes, scoped
from ..telemetry.spec import Instrument, Log2Buckets, SpanSpec
from .coverage import apply
from .records import COUNTERS as COUNTER_ATTRS
from .symbols import LAUNCH_FIELDS

STEP_SPAN = "hostagent.gpu_step"
GOVERNOR_FIELDS = ("budget", "cost_ns", "duty", "unsteered", "launch_rate_hz", "attached_overhead", "overhead")

INSTRUMENTS = (
    Instrument("hostagent.cuda.governor", "gauge", "",
               "launch-probe governor: budget, measured per-hit cost, duty cycle, estimated overhead"),
    Instrument("hostagent.nvidia.ioctls", "counter", "{ioctl}", "ioctls on NVIDIA device files by request code"),
    Instrument("hostagent.nvidia.ioctl.time", "counter", "s", "time in ioctls on NVIDIA device files by request code"),
    Instrument("hostagent.gpu_step.duration", "histogram", "s",
               "GPU steps of processes that mark no requests: a thread's launches since its previous sync, "
               "closed by a sync"),
    Instrument("hostagent.gpu_step.launches", "histogram", "{launch}", "kernel launches per GPU step"),
    Instrument("hostagent.cuda.call.duration", "log2_ns", "s",
               "duration of CUDA context switches, syncs, allocs, frees and NVIDIA ioctls (in-kernel log2 buckets)"),
)


def step_attributes(proc_attrs: dict) -> dict:
    """The step histograms' labels: bounded (no pid: steps come and go with processes)."""
    return {k: proc_attrs[k] for k in ("process.executable.name", "container.id", "k8s.pod.uid") if k in proc_attrs}


def step_span(step, proc_attrs: dict) -> SpanSpec:
    """Zero-touch mode: one GPU step (launches since the thread's previous sync, closed by a sync)
    of a process that marks no requests, as a root span."""
    attrs = {"process.pid": step.hdr.tgid}
    attrs.update({"thread.id": step.hdr.tid, "hostagent.gpu_step.sync.kind": step.sync_kind,
                  "hostagent.gpu_step.sync.time": step.sync_ns / 1e9})
    attrs.update(counter_attributes(step.counters, COUNTER_ATTRS))
    return SpanSpec(STEP_SPAN, step.begin_ns, max(step.hdr.ts_ns, step.begin_ns), attrs, resource=proc_attrs)


def rows(governor: dict, ioctls: list[dict], hists: list[dict]) -> dict:
    def ioctl_attrs(r):
        return {"process.pid": r["pid"], "hostagent.nvidia.device": r["device"], "hostagent.nvidia.ioctl.cmd": r["cmd"]}

    return {
        "hostagent.cuda.governor": [(governor[k], {"hostagent.governor.field": k}) for k in GOVERNOR_FIELDS
                              if governor.get(k) is not None],
        "hostagent.nvidia.ioctls": [(r["count"], ioctl_attrs(r)) for r in ioctls],
        "hostagent.nvidia.ioctl.time": [(r["ns"] / 1e9, ioctl_attrs(r)) for r in ioctls],
        "hostagent.cuda.call.duration": log2_rows(hists),
    }


def log2_rows(hists: list[dict]) -> list:
    """hist_rows (one per slot) -> one Log2Buckets per process and call kind."""
    by: dict[tuple, dict] = {}
    for r in hists:
        by.setdefault((r["pid"], r["kind"]), {})[r["slot"]] = r["count"]
    return [(Log2Buckets(slots), {"process.pid": pid, "hostagent.cuda.kind": kind})
            for (pid, kind), slots in sorted(by.items())]


def coverage_attributes(counters, cov: dict[str, tuple[float, float]]) -> dict:
    """A request's (or step's) launch counts where a probe was duty-cycled in its window, symbol by
    symbol: an estimate (hits / coverage, shown even when 0) with hostagent.cuda.coverage.<symbol>,
    or None (left off the span: unknown, never a false 0) with coverage 0. Exact counts are left as
    the counters gave them, without a coverage attribute."""
    counts, cov_of = apply({f: getattr(counters, f) for f in LAUNCH_FIELDS}, cov)
    attrs = {}
    for f, c in cov_of.items():
        name = COUNTER_ATTRS[f]
        attrs[name] = counts[f]
        attrs[COVERAGE_PREFIX + name.rsplit(".", 1)[1]] = round(c, 4)
    return attrs


COVERAGE_PREFIX = "hostagent.cuda.coverage."


def scope_coverage_attributes(counters, cov: dict[str, tuple[float, float]], scope: str, weighted: bool) -> dict:
    """The same for a zero-code request's process or group counts (hostagent.request.<scope>.*).
    weighted: the process's counts, each hit already scaled by the duty cycle's weight (per-process
    totals need that): an estimate as they are, labelled with the window's coverage, unknown (None)
    when the probe was off all of it; else hits, as coverage_attributes makes them."""
    if weighted:
        counts = {f: getattr(counters, f) for f in LAUNCH_FIELDS}
        _, cov_of = apply(counts, cov)
        est = {f: None if c == 0.0 else counts[f] for f, c in cov_of.items()}
    else:
        est, cov_of = apply({f: getattr(counters, f) for f in LAUNCH_FIELDS}, cov)
    attrs = {}
    for f, c in cov_of.items():
        name = COUNTER_ATTRS[f]
        attrs[scoped(name, scope)] = est[f]
        attrs[scoped(COVERAGE_PREFIX + name.rsplit(".", 1)[1], scope)] = round(c, 4)
    return attrs


def process_instruments(processes) -> list[Instrument]:
    """CUDA's kernel counters per watched process (core/processes.py rows)."""
    p = processes.per_process
    return [
        Instrument("hostagent.process.cuda.launches", "counter", "{launch}",
                   "kernel launches seen by the libcuda uprobes (scaled when duty-cycled)",
                   p(lambda c: [(sum(getattr(c, f) for f in LAUNCH_FIELDS), {})])),
        Instrument("hostagent.process.cuda.sync.time", "counter", "s",
                   "time in cuStreamSynchronize/cuCtxSynchronize/cuEventSynchronize",
                   p(lambda c: [(c.cu_sync_ns / 1e9, {})])),
        Instrument("hostagent.process.cuda.ctx.time", "counter", "s", "time in cuCtxPush/Pop/SetCurrent",
                   p(lambda c: [(c.cu_ctx_ns / 1e9, {})])),
        Instrument("hostagent.process.cuda.alloc.out_of_memory", "counter", "{error}",
                   "device allocations that failed with CUDA_ERROR_OUT_OF_MEMORY",
                   p(lambda c: [(c.cu_alloc_oom, {})])),
    ]
