"""NIC -> telemetry: link events counted by interface and kind (netlink)."""

from __future__ import annotations

from ..telemetry.spec import Instrument


def instruments(nic) -> list[Instrument]:
    """nic: the Nic capability, which drains the watcher into nic_counts on the agent's thread."""
    return [Instrument("hostagent.nic.link.events", "counter", "{event}", "NIC link events (netlink)",
                       lambda: [(n, {"network.interface.name": ifn, "hostagent.nic.event": kind})
                                for (ifn, kind), n in dict(nic.nic_counts).items()])]
