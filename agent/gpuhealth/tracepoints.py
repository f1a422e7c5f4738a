"""The health tracepoints health.bpf.c copies, by tracefs name, and why each may be absent. Apart from
their decoders so that core.probes, imported whenever the config is checked, stays light."""

from __future__ import annotations

HEALTH_EVENTS = ("ras/aer_event", "pci/pcie_link_event", "nvidia/nvidia_dev_xid")
MISSING_WHY = {
    "ras/aer_event": "kernel has no ras:aer_event (needs CONFIG_PCIEAER with the PCIe port driver)",
    "pci/pcie_link_event": "kernel has no pci:pcie_link_event (a newer kernel's tracepoint)",
    "nvidia/nvidia_dev_xid": "no nvidia:nvidia_dev_xid (NVIDIA driver module not loaded, or a driver without it)",
    "oom/mark_victim": "kernel has no oom:mark_victim (a 4.x kernel's tracepoint; needs CONFIG_TRACEPOINTS)",
}
