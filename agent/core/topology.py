"""Host topology facts the capabilities share: a PCI address's one spelling, what a PCIe link carries,
the NUMA nodes (sysfs). Pure but for the sysfs read."""

from __future__ import annotations

import os


def normalize_bdf(bus_id: str | bytes | None) -> str | None:
    """NVML's "00000000:00:06.0", sysfs's "0000:00:06.0" or a bare "00:06.0" -> "0000:00:06.0"."""
    if bus_id is None:
        return None
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode("ascii", "replace")
    parts = bus_id.strip().lower().split(":")
    try:
        if len(parts) == 3:
            return f"{int(parts[0], 16):04x}:{parts[1]}:{parts[2]}"
        if len(parts) == 2:
            return f"0000:{parts[0]}:{parts[1]}"
    except ValueError:
        pass
    return bus_id.strip().lower()


# Bytes per second one lane carries each way, after line coding: 8b/10b for Gen1-2, 128b/130b for
# Gen3-5, and Gen6's FLITs (242 of each 256 bytes are payload and sequence/CRC overhead aside, PCIe 6.0 spec)
_LANE_BYTES_S = {1: 2.5e9 * 8 / 10 / 8, 2: 5e9 * 8 / 10 / 8, 3: 8e9 * 128 / 130 / 8, 4: 16e9 * 128 / 130 / 8,
                 5: 32e9 * 128 / 130 / 8, 6: 64e9 * 242 / 256 / 8}


def link_capacity_bytes_s(gen: int | None, width: int | None) -> float | None:
    """What a link carries per direction at this generation and width (Gen5 x16: 63.0 GB/s), before
    TLP headers; None when either is unknown."""
    lane = _LANE_BYTES_S.get(gen) if gen else None
    return lane * width if lane and width and width > 0 else None


def numa_nodes(sys_root: str = "/sys") -> set[int]:
    """The host's NUMA nodes (/sys/devices/system/node/nodeN); empty without CONFIG_NUMA."""
    try:
        names = os.listdir(f"{sys_root}/devices/system/node")
    except OSError:
        return set()
    return {int(n[4:]) for n in names if n.startswith("node") and n[4:].isdigit()}
