"""GPU health -> telemetry: NVML samples as metrics, Xid counts, and what a request's window saw of
its GPUs (samples aggregated over it, Xid/PCIe/NIC events in it)."""

from __future__ import annotations

from ..core.capability import Evidence
from ..telemetry.spec import EventSpec, Instrument


def evidence(gpu, fr) -> Evidence:
    return Evidence(gpu.request_attributes(fr.tgid, fr.begin_ns, fr.end_ns),
                    events=tuple(EventSpec(n, t, a) for n, t, a in gpu.events_between(fr.tgid, fr.begin_ns, fr.end_ns)))


def instruments(gpu) -> list[Instrument]:
    """Read at collection time from the sampler's published snapshot (its own threads call NVML)."""
    def per_gpu(fn):
        def read():
            out = []
            for s in gpu.sampler.snapshot().values():
                base = {"mcp.gpu.index": s.index, "mcp.gpu.uuid": s.uuid or "", "mcp.gpu.pci_bus_id": s.pci_bus_id or ""}
                for v, extra in fn(s):
                    if v is not None:
                        out.append((v, {**base, **extra}))
            return out
        return read

    return [
        Instrument("mcp.gpu.up", "gauge", "", "1 when the GPU answers NVML, 0 when marked down",
                   per_gpu(lambda s: [(int(s.up), {})])),
        Instrument("mcp.gpu.utilization", "gauge", "%", read=per_gpu(lambda s: [
            (s.util_gpu_pct, {"mcp.gpu.engine": "sm"}), (s.util_mem_pct, {"mcp.gpu.engine": "memory"})])),
        Instrument("mcp.gpu.memory.used_bytes", "gauge", "By", read=per_gpu(lambda s: [(s.mem_used_bytes, {})])),
        Instrument("mcp.gpu.clock_mhz", "gauge", "MHz", read=per_gpu(lambda s: [
            (s.sm_clock_mhz, {"mcp.gpu.clock": "sm"}), (s.mem_clock_mhz, {"mcp.gpu.clock": "memory"})])),
        Instrument("mcp.gpu.power_mw", "gauge", "mW", read=per_gpu(lambda s: [(s.power_mw, {})])),
        Instrument("mcp.gpu.temperature_c", "gauge", "Cel", read=per_gpu(lambda s: [(s.temperature_c, {})])),
        Instrument("mcp.gpu.throttle", "gauge", "", "1 per active clock throttle reason", per_gpu(lambda s: [
            (1, {"mcp.gpu.throttle_reason": r}) for r in (s.throttle_reasons or ())])),
        Instrument("mcp.gpu.pcie.link", "gauge", "", "NVML's view of the GPU's PCIe link", per_gpu(lambda s: [
            (s.pcie_gen, {"mcp.pcie.field": "gen"}), (s.pcie_gen_max, {"mcp.pcie.field": "gen_max"}),
            (s.pcie_width, {"mcp.pcie.field": "width"}), (s.pcie_width_max, {"mcp.pcie.field": "width_max"})])),
        Instrument("mcp.gpu.pcie.replays", "counter", read=per_gpu(lambda s: [(s.pcie_replay_count, {})])),
        Instrument("mcp.gpu.process.memory_bytes", "gauge", "By", read=per_gpu(lambda s: [
            (p.used_memory_bytes, {"process.pid": p.pid}) for p in (s.processes or ())])),
        Instrument("mcp.gpu.xid", "counter", "", "Xid errors by code (the nvidia:nvidia_dev_xid BPF probe, else NVML events)",
                   lambda: [(n, {"mcp.gpu.xid": code}) for code, n in dict(gpu.xid.counts).items()]),
    ]
