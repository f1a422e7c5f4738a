"""NIC -> telemetry: link events counted by interface and kind (netlink)."""

from __future__ import annotations

from ..telemetry.spec import Instrument


def instruments(gpu) -> list[Instrument]:
    """gpu: gpuhealth GpuHealth, which drains the NIC watcher into nic_counts on the agent's thread."""
    return [Instrument("mcp.nic.link_events", "counter", "", "NIC link events (netlink)",
                       lambda: [(n, {"network.interface.name": ifn, "mcp.nic.event": kind})
                                for (ifn, kind), n in dict(gpu.nic_counts).items()])]
