"""PCIe link state and AER counters per GPU path, read from sysfs (under an overridable root, psutil's
habit) by PciePoller.poll().

Kernel facts relied on:
- /sys/bus/pci/devices/<bdf> links to /sys/devices/pci<dom>:<bus>/<port>/.../<bdf>: the directories
  between the host bridge and the GPU are the bridges (root port, switch ports) on its path.
- current_link_speed reads "32.0 GT/s PCIe" (older kernels: "32.0 GT/s", "Unknown"): 2.5/5/8/16/32/64
  GT/s are Gen1..Gen6. A bridge's link attributes describe its Link Status register: for a root or
  downstream port the link below it, for an upstream port the link above it; an endpoint's, its own.
- aer_dev_correctable/fatal/nonfatal (CONFIG_PCIEAER) are "Name count" lines ending in
  TOTAL_ERR_COR / TOTAL_ERR_FATAL / TOTAL_ERR_NONFATAL; they count since boot (reset on device reset).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import Mapping

NVIDIA_VENDOR = 0x10DE
_BDF = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_SPEED = re.compile(r"([0-9.]+)\s*GT/s")
GEN_BY_GTS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
AER_FILES = (("correctable", "aer_dev_correctable"), ("nonfatal", "aer_dev_nonfatal"), ("fatal", "aer_dev_fatal"))


def parse_link_speed(text: str | None) -> float | None:
    m = _SPEED.search(text or "")
    return float(m.group(1)) if m else None


def gen_of(speed_gts: float | None) -> int | None:
    return GEN_BY_GTS.get(speed_gts) if speed_gts is not None else None


def parse_aer(text: str) -> dict[str, int]:
    """An aer_dev_* file -> {"RxErr": 0, ..., "TOTAL_ERR_COR": 0}; malformed lines are skipped."""
    out = {}
    for line in text.splitlines():
        name, _, count = line.strip().rpartition(" ")
        if name and count.isdigit():
            out[name.strip()] = int(count)
    return out


@dataclass(frozen=True)
class AerCounts:
    """One device's AER counters; each kind maps counter name -> count (TOTAL_ERR_* included)."""

    correctable: Mapping[str, int] = field(default_factory=dict)
    nonfatal: Mapping[str, int] = field(default_factory=dict)
    fatal: Mapping[str, int] = field(default_factory=dict)

    def total(self, kind: str) -> int:
        counts = getattr(self, kind)
        tot = next((v for k, v in counts.items() if k.startswith("TOTAL_ERR")), None)
        return tot if tot is not None else sum(counts.values())

    def flat(self) -> dict[str, int]:
        """{"correctable": total, "correctable.RxErr": n, ...} for deltas and metrics."""
        out = {}
        for kind, _ in AER_FILES:
            out[kind] = self.total(kind)
            out.update({f"{kind}.{k}": v for k, v in getattr(self, kind).items() if not k.startswith("TOTAL_ERR")})
        return out


@dataclass(frozen=True)
class LinkState:
    bdf: str
    role: str  # "gpu" | "bridge"
    present: bool = True  # False: the device's sysfs directory is gone (fell off the bus, removed)
    speed_gts: float | None = None
    width: int | None = None
    max_speed_gts: float | None = None
    max_width: int | None = None
    aer: AerCounts | None = None  # None: no aer_* files (no CONFIG_PCIEAER, or not a PCIe device)

    @property
    def gen(self) -> int | None:
        return gen_of(self.speed_gts)

    @property
    def max_gen(self) -> int | None:
        return gen_of(self.max_speed_gts)


@dataclass(frozen=True)
class PcieSnapshot:
    t_ns: int  # CLOCK_MONOTONIC
    links: Mapping[str, LinkState]  # bdf -> state, GPUs and their bridges
    paths: Mapping[str, tuple[str, ...]]  # GPU bdf -> bridges from the nearest up to the root port


class PciePoller:
    """Finds NVIDIA GPUs (vendor 0x10de, class 0x03xxxx: VGA or 3D controller; NVSwitches are 0x0680)
    and the bridges above each, then reads their link state and AER counters: ~10 small sysfs reads per
    device, cheap enough for the agent's tick. rescan() re-walks the tree (hotplug, a GPU back)."""

    def __init__(self, sysfs_root: str = "/sys", clock=time.monotonic_ns, rescan_s: float = 60.0):
        self.root = sysfs_root.rstrip("/") or "/"
        self._clock = clock
        self._rescan_ns = int(rescan_s * 1e9)
        self._scanned_ns: int | None = None
        self._paths: dict[str, tuple[str, ...]] | None = None
        self._dirs: dict[str, str] = {}

    def _read(self, path: str) -> str | None:
        try:
            with open(path, encoding="ascii", errors="replace") as f:
                return f.read().strip()
        except OSError:
            return None

    def rescan(self) -> dict[str, tuple[str, ...]]:
        base = os.path.join(self.root, "bus/pci/devices")
        devices_top = os.path.realpath(os.path.join(self.root, "devices"))
        paths, dirs = {}, {}
        try:
            names = sorted(os.listdir(base))
        except OSError:
            names = []
        for bdf in names:
            d = os.path.join(base, bdf)
            vendor, cls = self._read(f"{d}/vendor"), self._read(f"{d}/class")
            try:
                if int(vendor or "0", 16) != NVIDIA_VENDOR or (int(cls or "0", 16) >> 16) != 0x03:
                    continue
            except ValueError:
                continue
            real = os.path.realpath(d)
            dirs[bdf] = real
            chain = []
            up = os.path.dirname(real)
            while up.startswith(devices_top + os.sep) and _BDF.match(os.path.basename(up)):
                chain.append(os.path.basename(up))
                dirs[os.path.basename(up)] = up
                up = os.path.dirname(up)
            paths[bdf] = tuple(chain)
        self._paths, self._dirs = paths, dirs
        self._scanned_ns = self._clock()
        return paths

    def read_link(self, bdf: str, role: str) -> LinkState:
        d = self._dirs.get(bdf) or os.path.join(self.root, "bus/pci/devices", bdf)
        if not os.path.isdir(d):
            return LinkState(bdf, role, present=False)
        width, max_width = self._read(f"{d}/current_link_width"), self._read(f"{d}/max_link_width")
        aer = {}
        for kind, name in AER_FILES:
            text = self._read(f"{d}/{name}")
            if text is not None:
                aer[kind] = parse_aer(text)
        return LinkState(
            bdf, role, True,
            speed_gts=parse_link_speed(self._read(f"{d}/current_link_speed")),
            width=int(width) if width and width.isdigit() and int(width) > 0 else None,
            max_speed_gts=parse_link_speed(self._read(f"{d}/max_link_speed")),
            max_width=int(max_width) if max_width and max_width.isdigit() and int(max_width) > 0 else None,
            aer=AerCounts(**aer) if aer else None,
        )

    def poll(self) -> PcieSnapshot:
        """Link state of every GPU and bridge; the tree is re-walked every rescan_s (a GPU that fell
        off the bus reads present=False until then, so an episode sees it go)."""
        if self._paths is None or self._clock() - self._scanned_ns >= self._rescan_ns:
            self.rescan()
        links = {}
        for gpu, chain in self._paths.items():
            links[gpu] = self.read_link(gpu, "gpu")
            for b in chain:
                if b not in links:
                    links[b] = self.read_link(b, "bridge")
        return PcieSnapshot(self._clock(), links, dict(self._paths))
