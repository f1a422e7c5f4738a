"""GPU health -> telemetry: NVML samples as metrics, Xid counts, and what a request's window saw of
its GPUs (samples aggregated over it, Xid/PCIe/NIC events in it)."""

from __future__ import annotations

from ..core.capability import Evidence
from ..core.topology import link_capacity_bytes_s
from ..telemetry.spec import EventSpec, Instrument


def evidence(gpu, fr) -> Evidence:
    return Evidence(gpu.request_attributes(fr.tgid, fr.begin_ns, fr.end_ns),
                    events=tuple(EventSpec(n, t, a) for n, t, a in gpu.events_between(fr.tgid, fr.begin_ns, fr.end_ns)))


def _ratio(pct):
    return None if pct is None else pct / 100


def _scaled(v, k):
    return None if v is None else v * k


def instruments(gpu) -> list[Instrument]:
    """Read at collection time from the sampler's published snapshot (its own threads call NVML).
    OpenTelemetry's hardware conventions (hw.*) where they name the quantity, in base units (ratio,
    By, W, Cel, Hz); ours under hostagent.gpu.* for what they do not name."""
    def per_gpu(fn):
        def read():
            out = []
            for s in gpu.sampler.snapshot().values():
                base = {"hw.id": s.uuid or f"gpu{s.index}", "hw.type": "gpu", "hw.vendor": "NVIDIA",
                        "hostagent.gpu.index": s.index, "hostagent.gpu.pci_bus_id": s.pci_bus_id or ""}
                for v, extra in fn(s):
                    if v is not None:
                        out.append((v, {**base, **extra}))
            return out
        return read

    return [
        Instrument("hw.status", "gauge", "", "1 in the GPU's state: ok while it answers NVML, failed when marked down",
                   per_gpu(lambda s: [(int(s.up), {"hw.state": "ok"}), (int(not s.up), {"hw.state": "failed"})])),
        Instrument("hw.gpu.utilization", "gauge", "1", "share of time a kernel ran on the GPU (NVML)",
                   per_gpu(lambda s: [(_ratio(s.util_gpu_pct), {})])),
        Instrument("hw.gpu.memory.utilization", "gauge", "1", "share of time device memory was read or written (NVML)",
                   per_gpu(lambda s: [(_ratio(s.util_mem_pct), {})])),
        Instrument("hw.gpu.memory.usage", "gauge", "By", "device memory used (as nvidia-smi's memory.used)",
                   per_gpu(lambda s: [(s.mem_used_bytes, {})])),
        Instrument("hw.gpu.memory.limit", "gauge", "By", "device memory size",
                   per_gpu(lambda s: [(s.mem_total_bytes, {})])),
        Instrument("hostagent.gpu.clock.frequency", "gauge", "Hz", "SM and memory clocks", per_gpu(lambda s: [
            (_scaled(s.sm_clock_mhz, 1_000_000), {"hostagent.gpu.clock": "sm"}),
            (_scaled(s.mem_clock_mhz, 1_000_000), {"hostagent.gpu.clock": "memory"})])),
        Instrument("hw.power", "gauge", "W", "GPU power draw", per_gpu(lambda s: [(_scaled(s.power_mw, 1e-3), {})])),
        Instrument("hw.temperature", "gauge", "Cel", "GPU temperature", per_gpu(lambda s: [(s.temperature_c, {})])),
        Instrument("hostagent.gpu.throttle", "gauge", "", "1 per active clock throttle reason", per_gpu(lambda s: [
            (1, {"hostagent.gpu.throttle_reason": r}) for r in (s.throttle_reasons or ())])),
        Instrument("hostagent.gpu.pcie.link", "gauge", "", "NVML's view of the GPU's PCIe link", per_gpu(lambda s: [
            (s.pcie_gen, {"hostagent.pcie.field": "gen"}), (s.pcie_gen_max, {"hostagent.pcie.field": "gen_max"}),
            (s.pcie_width, {"hostagent.pcie.field": "width"}), (s.pcie_width_max, {"hostagent.pcie.field": "width_max"})])),
        Instrument("hostagent.gpu.pcie.replays", "counter", "{replay}", "PCIe replays the GPU counted (NVML)",
                   per_gpu(lambda s: [(s.pcie_replay_count, {})])),
        # a model loading is host-to-device traffic: receive against capacity says whether the link or
        # the host side (storage, page cache, pageable copies) sets its pace
        Instrument("hostagent.gpu.pcie.throughput", "gauge", "By/s",
                   "PCIe bytes/s over NVML's last 20 ms sample (every gpu.slow_period_s): receive = host to GPU, "
                   "transmit = GPU to host", per_gpu(lambda s: [
                       (_scaled(s.pcie_rx_kbytes_s, 1024), {"network.io.direction": "receive"}),
                       (_scaled(s.pcie_tx_kbytes_s, 1024), {"network.io.direction": "transmit"})])),
        Instrument("hostagent.gpu.pcie.capacity", "gauge", "By/s",
                   "bytes/s the GPU's link carries each way at its current generation and width (NVML's view)",
                   per_gpu(lambda s: [(link_capacity_bytes_s(s.pcie_gen, s.pcie_width), {})])),
        Instrument("hostagent.gpu.nvlink.links", "gauge", "{link}",
                   "NVLink links by state (NVML, every gpu.slow_period_s); absent on a GPU without NVLink",
                   per_gpu(lambda s: [] if s.nvlink is None else [
                       (len(s.nvlink.active), {"hostagent.nvlink.state": "active"}),
                       (len(s.nvlink.links) - len(s.nvlink.active), {"hostagent.nvlink.state": "inactive"})])),
        Instrument("hostagent.gpu.nvlink.links.down", "gauge", "{link}",
                   "NVLink links this agent saw active on the GPU that are not now (a board without a bridge "
                   "reports every link inactive from the start: not down)",
                   per_gpu(lambda s: [] if s.nvlink is None else [(len(s.nvlink.down), {})])),
        Instrument("hostagent.gpu.nvlink.errors", "counter", "{error}",
                   "NVLink data-link errors summed over the GPU's links (NVML, since the driver loaded)",
                   per_gpu(lambda s: [] if s.nvlink is None else [
                       (v, {"hostagent.nvlink.error.type": k}) for k, v in s.nvlink.errors])),
        Instrument("hostagent.gpu.process.memory.usage", "gauge", "By", "device memory used by each process", per_gpu(lambda s: [
            (p.used_memory_bytes, {"process.pid": p.pid}) for p in (s.processes or ())])),
        Instrument("hostagent.gpu.xid.errors", "counter", "{error}",
                   "Xid errors by code (the nvidia:nvidia_dev_xid BPF probe, else NVML events)",
                   lambda: [(n, {"hostagent.gpu.xid.code": code}) for code, n in dict(gpu.xid.counts).items()]),
    ]
