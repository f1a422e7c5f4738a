"""CUDA driver calls and NVIDIA ioctls, as the core sees them (core/capability.py): the probes
(probeset.CudaProbes: libraries found, attached per inode, duty-cycled within the overhead budget),
zero-touch GPU step records -> spans, a request's findings and launch coverage, the probes' metrics.
"""

from __future__ import annotations

import time
from dataclasses import replace

from ..core.capability import Capability, Evidence
from . import steps
from .finder import trusted_libcuda
from . import telemetry as cuda_telemetry
from ..core.probes import ProbePlan
from .probeset import CudaProbes
from .section import CudaSection
from .symbols import UPROBE_ROWS


class Cuda(Capability):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.processes, self.health = ctx.processes, ctx.health
        self.telemetry = None  # start(), once the exporters are built
        self.probes: CudaProbes | None = None
        self.gate = steps.OutlierGate(ctx.cfg.cuda_step_span_min_ms / 1000, ctx.cfg.cuda_step_spans_per_s)
        self.step_log = steps.StepLog()  # for the requests in flight beside the steps
        # tgid -> its process tree's root (requests.group = tree)
        self.root_of = ctx.inputs.get("requests.tree_root", lambda tgid: None)

    def provided(self) -> dict:
        # the watch set's: a libcuda mapping makes a GPU process only if the finder's trust check passes
        return {"watch.libcuda_trusted": trusted_libcuda}

    def loaded(self) -> None:
        """Uprobes per libcuda inode, the NVIDIA ioctl programs and the launch-probe governor: only when
        cuda.bpf.c's programs attached; right after the load, so that they arm with the rest."""
        cfg, plan = self.ctx.cfg, self.ctx.plan
        if not any(s.spec.program == "cuda.bpf.c" and s.state == "attached" for s in plan.statuses.values()):
            return
        self.probes = CudaProbes(self.ctx.bpf, plan, budget=cfg.cuda_overhead_budget,
                                 auto_watch=cfg.process_watch == "gpu", device_globs=cfg.cuda_device_globs,
                                 slice_s=cfg.cuda_duty_slice_s, proc_root=self.ctx.proc_root,
                                 max_libraries=cfg.cuda_max_libraries)
        self.probes.start()

    def start(self) -> list:
        self.telemetry = self.ctx.telemetry
        return []

    def stop(self) -> None:
        """Before the BPF object goes: the uprobes and tracepoint fds hold its programs."""
        if self.probes is not None:
            self.probes.stop()
            self.probes = None

    def routes(self) -> dict:
        return {t: r.with_handlers(self.on_step) for t, r in steps.DECODERS.items()}

    def instruments(self):
        return [*cuda_telemetry.INSTRUMENTS, *cuda_telemetry.process_instruments(self.ctx.processes)]

    def section(self):
        return CudaSection()

    @classmethod
    def report(cls, bpf, plan) -> str:
        """Every libcuda mapped now and its symbols, found, not attached (probe_report)."""
        return ("libcuda uprobes (`run` arms them per library inode as processes map it; found here, not "
                "attached):\n" + probe_report(bpf, plan))

    def on_step(self, step: steps.GpuStep) -> None:
        """Every step into the histograms; a span only for an outlier (steps.OutlierGate)."""
        self.step_log.add(step)
        if self.telemetry is None:
            return
        proc_attrs = self.processes.attrs(step.hdr.tgid, step.hdr.comm)
        dur_s = max(step.hdr.ts_ns - step.begin_ns, 0) / 1e9
        labels = cuda_telemetry.step_attributes(proc_attrs)
        self.telemetry.record("hostagent.gpu_step.duration", dur_s, labels)
        self.telemetry.record("hostagent.gpu_step.launches", step.launches, labels)
        if not self.gate.admit(step.hdr.tgid, dur_s, time.monotonic()):
            return
        spec = cuda_telemetry.step_span(step, proc_attrs)
        cov = self._coverage(step.counters, step.hdr.tgid, spec.start_ns, spec.end_ns)
        if cov:
            spec = replace(spec, attributes={**spec.attributes, **cov})
        self.telemetry.span(spec)

    def evidence(self, fr) -> Evidence:
        """Findings, the launch counts' coverage (an estimate or unknown where a launch probe was
        duty-cycled: these replace the counters' own attributes), the serving group's GPU steps."""
        found = steps.findings(fr.counters, fr.end_ns - fr.begin_ns)
        # the serving group's steps (a batching engine's): an HTTP request's group (cgroup or process
        # tree), else the thread's cgroup
        root = fr.attributes.get("hostagent.request.group.root_pid")
        if root is not None:
            roots: dict[int, int | None] = {}

            def member(cg: int, tgid: int) -> bool:
                if tgid not in roots:
                    roots[tgid] = self.root_of(tgid)
                return roots[tgid] == root
        else:
            group = fr.attributes.get("hostagent.request.group.cgroup_id") or fr.cgroup_id

            def member(cg: int, tgid: int) -> bool:
                return cg == group
        attrs = {**{f"hostagent.finding.{k}": v for k, v in found.items()},
                 **self._coverage(fr.counters, fr.tgid, fr.begin_ns, fr.end_ns),
                 **self.step_log.summary(member, fr.begin_ns, fr.end_ns)}
        if self.probes is not None:
            for scope, counters in fr.scopes:  # a zero-code request's process and group counts
                # a group spans processes: the least coverage of every libcuda followed
                cov = self.probes.launch_coverage(fr.tgid if scope == "process" else None, fr.begin_ns, fr.end_ns)
                attrs.update(cuda_telemetry.scope_coverage_attributes(counters, cov, scope, weighted=scope == "process"))
        return Evidence(attrs)

    def _coverage(self, counters, pid: int, t0_ns: int, t1_ns: int) -> dict:
        """The launch counts of a window where a probe was duty-cycled: estimates or unknown, labelled
        (cuda/telemetry.coverage_attributes); {} when every count is exact or no probes run."""
        if self.probes is None:
            return {}
        return cuda_telemetry.coverage_attributes(counters, self.probes.launch_coverage(pid, t0_ns, t1_ns))

    def tick(self) -> None:
        """After the map read: the governor's state, ioctl and latency rows; refusals and errors."""
        probes = self.probes
        if probes is None:
            return
        for row in UPROBE_ROWS:  # armed / waiting / ... change as libraries come and go (probe-state gauge)
            if row in probes.plan.statuses and row in self.health.probes:
                self.health.probes[row] = probes.plan.statuses[row].state
        if self.telemetry is None:
            return
        # distinct libcuda files not followed (agent/cuda/libtrust.py, cuda.max_libraries)
        self.health.rejected["libcuda_refused"] = probes.refused_total
        self.health.errors["cuda"] = probes.error_count
        self.telemetry.publish(cuda_telemetry.rows(probes.governor_status(), probes.ioctl_rows(), probes.hist_rows()))


def probe_report(bpf, plan: ProbePlan, proc_root: str = "/proc") -> str:
    """For `mcp-agent probes`: every libcuda mapped now and its symbols, found, not attached (attaching
    and detaching ~40 uprobes would take seconds); the plan's CUDA rows are updated in place: found
    (symbols resolved in a mapped libcuda), waiting (none mapped now) or missing, never armed."""
    cp = CudaProbes(bpf, plan, governor=False, attach_uprobes=False, proc_root=proc_root)
    cp.start(thread=False)
    cp.rescan(full=True)
    rows = cp._symbol_rows()  # this round's (symbol_rows() is the last service pass's)
    cp.stop()
    how = f"mechanism: {cp._up.mechanism}\n"
    return how + (render_symbols(rows) if rows else
                  "no process maps libcuda.so now: `run` arms the uprobes as processes map it")


def render_symbols(rows: list[dict]) -> str:
    """`mcp-agent probes` detail: one line per (libcuda file, symbol)."""
    head = ("LIBRARY", "SYMBOL", "STATE", "DETAIL")
    lines = [head] + [(r["library"], r["symbol"], r["state"] + (" (duty-cycled)" if r["duty_cycled"] else ""),
                       r["reason"]) for r in rows]
    w = [max(len(x[i]) for x in lines) for i in range(3)]
    return "\n".join(f"{a:<{w[0]}}  {b:<{w[1]}}  {c:<{w[2]}}  {d}" for a, b, c, d in lines)
