"""GPU health: NVML samples (nvml.py, sampler threads) and Xid errors (xid.py), from the
nvidia:nvidia_dev_xid tracepoint (bpf/gpuhealth.bpf.c's raw copy, decoded by the core with its run-time
format) when it is there, else NVML's Xid events (the fallback, so no Xid counts twice) -> GPU metrics,
a request's GPU samples and Xid events. Everything here is read on the agent's thread from the sources'
own snapshots: no NVML call happens on the agent's thread.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from ..core.capability import Capability, Evidence, SourceStatus
from ..core.topology import normalize_bdf
from . import telemetry as T
from .nvml import NvmlSampler
from .section import GpuSection
from .xid import XidEvent, XidRecord, XidWatcher

log = logging.getLogger("mcp_hostagent")

KEEP_EVENTS = 256


class GpuHealth(Capability):
    def __init__(self, ctx):
        super().__init__(ctx)
        cfg, nvml_module = ctx.cfg, ctx.options.get("nvml_module")
        self.enabled = cfg.gpu_enabled
        self.sampler = NvmlSampler(nvml_module, period_s=cfg.gpu_sample_period_s, slow_period_s=cfg.gpu_slow_period_s)
        self.xid = XidWatcher(nvml_module)
        self.sources: dict[str, SourceStatus] = {}
        self.xids: deque = deque(maxlen=KEEP_EVENTS)  # recent XidEvent, for request span events

    def provided(self) -> dict:
        return {"gpu.util_by_bdf": self.util_by_bdf, "gpu.gpus_of": self.gpus_of,
                "gpu.processes": self.gpu_processes, "gpu.links": self.links,
                "gpu.nvml_attached": lambda: self.sources.get("nvml", SourceStatus("", "")).state == "attached"}

    def prepare(self) -> None:
        self.warm()

    def warm(self) -> None:
        """Begin NVML's init (import pynvml, nvmlInit: most of start()'s ~0.1 s on the GPU hosts) in a
        thread, to overlap the BPF compile; start() then finds it done (Nvml.init holds a lock)."""
        if self.enabled:
            try:
                threading.Thread(target=self.sampler.nvml.init, args=(True,), name="mcp-nvml-init",
                                 daemon=True).start()
            except RuntimeError:  # no thread (TasksMax): start() inits it
                pass

    def start(self) -> list[SourceStatus]:
        """With the gpu_xid BPF probe attached, NVML's Xid events would count each Xid again: they are
        its fallback only."""
        bpf_xid = self.ctx.attached("gpu_xid")
        if not self.enabled:
            for name in ("nvml", "nvml_xid"):
                self.sources[name] = SourceStatus(name, "disabled", "gpu.enabled = false")
            return list(self.sources.values())
        ok = self.sampler.start()
        self.sources["nvml"] = SourceStatus("nvml", "attached" if ok else "missing",
                                            "" if ok else (self.sampler.reason or "NVML unavailable"))
        if bpf_xid:
            self.sources["nvml_xid"] = SourceStatus(
                "nvml_xid", "disabled", "the gpu_xid BPF probe (nvidia:nvidia_dev_xid) delivers Xids; "
                "NVML Xid events are its fallback")
        elif ok:
            xok = self.xid.start()
            self.sources["nvml_xid"] = SourceStatus("nvml_xid", "attached" if xok else "missing",
                                                    "" if xok else (self.xid.reason or "no Xid events"))
        else:
            self.sources["nvml_xid"] = SourceStatus("nvml_xid", "missing", "needs NVML")
        return list(self.sources.values())

    def util_by_bdf(self) -> dict[str, float | None]:
        """GPU PCI address -> SM utilisation % of the GPUs that answer (the link judge's load)."""
        return {s.pci_bus_id: s.util_gpu_pct for s in self.sampler.snapshot().values() if s.up}

    def links(self) -> dict:
        """GPU PCI address -> (gen, gen max, width, width max, utilisation %) as NVML last sampled them."""
        return {s.pci_bus_id: (s.pcie_gen, s.pcie_gen_max, s.pcie_width, s.pcie_width_max, s.util_gpu_pct)
                for s in self.sampler.snapshot().values()}

    def section(self):
        return GpuSection(self.sampler, self.xid, self.xids, self.sources)

    # ---- the Xid tracepoint's raw copies (t_ns: bpf_ktime_get_ns(), CLOCK_MONOTONIC, as NVML's events) ----
    def raw(self, kind: int, rec: XidRecord, t_ns: int) -> None:
        self.on_xid(self._xid_event(t_ns, rec))

    def _xid_event(self, t_ns: int, x: XidRecord) -> XidEvent:
        bdf = normalize_bdf(x.dev)
        gpu = next((s for s in self.sampler.snapshot().values() if normalize_bdf(s.pci_bus_id) == bdf), None)
        proc = x.process
        return XidEvent(t_ns, gpu.index if gpu else None, gpu.uuid if gpu else None, bdf, x.error_code,
                        source="bpf", msg=x.msg, pid=proc[0] if proc else None)

    def on_xid(self, ev: XidEvent) -> None:
        """An Xid from the BPF tracepoint: kept for request span events and top's findings, and counted
        in the one counts table (xid.counts, NVML's watcher's, idle when this source is live)."""
        self.xids.append(ev)
        self.xid.counts[ev.xid] = self.xid.counts.get(ev.xid, 0) + 1

    def tick(self) -> None:
        """Drain NVML's Xid events (its watcher thread waits on them)."""
        if self.sources.get("nvml_xid", SourceStatus("", "")).state == "attached":
            self.xids.extend(self.xid.drain())

    def gpu_processes(self) -> dict[int, set[str]]:
        """pid -> PCI addresses of the GPUs it has compute contexts on, for every process NVML lists."""
        out: dict[int, set[str]] = {}
        for s in self.sampler.snapshot().values():
            for p in s.processes:
                out.setdefault(p.pid, set()).add(s.pci_bus_id)
        return out

    def gpus_of(self, pid: int) -> dict[int, str]:
        """GPU index -> PCI address of the GPUs the process has contexts on (NVML's process lists)."""
        snap = self.sampler.snapshot()
        return {i: snap[i].pci_bus_id for i in self.sampler.gpus_for_pid(pid) if i in snap}

    def request_attributes(self, pid: int, t0_ns: int, t1_ns: int) -> dict:
        """GPU samples overlapping the request, for each GPU the process uses (first one flat,
        others as hostagent.gpu.<index>.*)."""
        attrs: dict = {}
        for n, gpu in enumerate(sorted(self.gpus_of(pid))):
            agg = self.sampler.aggregate(gpu, t0_ns, t1_ns, pid=pid)
            if agg is not None:
                attrs.update(agg.attributes("hostagent.gpu" if n == 0 else f"hostagent.gpu.{gpu}"))
        return attrs

    def events_between(self, pid: int, t0_ns: int, t1_ns: int) -> list[tuple[str, int, dict]]:
        """(name, t_ns, attributes) of Xid events in the window on the process's GPUs (or naming it)."""
        bdfs = set(self.gpus_of(pid).values())
        # NVML's Xid events carry no message: the attribute is left off (OTel drops None with a warning)
        return [("hostagent.gpu.xid", x.t_ns, {"hostagent.gpu.xid.code": x.xid, "hostagent.gpu.pci_bus_id": x.pci_bus_id or "",
                                         "hostagent.gpu.xid.source": x.source,
                                         **({"hostagent.gpu.xid.message": x.msg} if x.msg is not None else {})})
                for x in self.xids if t0_ns <= x.t_ns <= t1_ns
                and (normalize_bdf(x.pci_bus_id) in bdfs or (x.pid is not None and x.pid == pid))]

    def evidence(self, fr) -> Evidence:
        """The request's window on its process's GPUs: samples aggregated, Xid events."""
        return T.evidence(self, fr)

    def instruments(self) -> list:
        return T.instruments(self)

    def stop(self) -> None:
        for src in (self.sampler, self.xid):
            try:
                src.stop()
            except Exception as e:  # stopping must finish for the others
                log.debug("stop %s: %s", type(src).__name__, e)
