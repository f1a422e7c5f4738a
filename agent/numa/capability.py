"""NUMA locality: how much of a GPU process's CPU time runs on a node other than its GPUs'.

A serving thread on a remote node pays for every host-device copy and every page it touches
across the socket interconnect. The kernel side (bpf/requests.bpf.c, sched_switch) splits each
traced thread's on-CPU slice by the node it ran on (bpf_get_numa_node_id()) against the process's
home node in the map numa_home; this module keeps that map: a process's home is the node of the
GPUs NVML lists it on, when they share one. The counters reach request spans and per-process
metrics with the other kernel counters (requests/telemetry.py, core/processes.py).

A GPU's node is its PCI device's numa_node in sysfs (drivers/pci/pci-sysfs.c), -1 when the
firmware gives no proximity. On a host with one node, every CPU is local whatever that says; on
several, a -1 leaves the process without a home: its time counts as on-CPU only, never as local.
"""

from __future__ import annotations

import ctypes
import os

from ..core.capability import Evidence, NONE, SourceStatus
from ..gpuhealth.nvml import normalize_bdf

HOME_NODE = "hostagent.numa.home_node"


def nodes(sys_root: str = "/sys") -> set[int]:
    """The host's NUMA nodes (/sys/devices/system/node/nodeN); empty without CONFIG_NUMA."""
    try:
        names = os.listdir(f"{sys_root}/devices/system/node")
    except OSError:
        return set()
    return {int(n[4:]) for n in names if n.startswith("node") and n[4:].isdigit()}


def device_node(bdf: str | None, host_nodes: set[int], sys_root: str = "/sys") -> int | None:
    """The NUMA node of a PCI device, or None when it has none the kernel knows of."""
    if len(host_nodes) == 1:
        return next(iter(host_nodes))  # one node: every CPU is the device's
    bdf = normalize_bdf(bdf)
    if bdf is None:
        return None
    try:
        with open(f"{sys_root}/bus/pci/devices/{bdf}/numa_node") as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node in host_nodes else None


def home_nodes(gpu_processes: dict[int, set[str]], node_of) -> dict[int, int]:
    """pid -> its home node, for processes whose GPUs all sit on one known node. A process spread
    over GPUs of two nodes has no home: no CPU is local to all of them."""
    homes = {}
    for pid, bdfs in gpu_processes.items():
        found = {node_of(b) for b in bdfs}
        if len(found) == 1 and None not in found:
            homes[pid] = found.pop()
    return homes


class Numa:
    def __init__(self, *, gpu_processes=lambda: {}, sysfs_root: str = "/sys", proc_root: str = "/proc"):
        """gpu_processes() -> {pid: GPU PCI addresses it has contexts on} (gpuhealth)."""
        self.gpu_processes = gpu_processes
        self.sysfs_root, self.proc_root = sysfs_root, proc_root
        self.nodes: set[int] = set()
        self.homes: dict[int, int] = {}  # what numa_home holds, as this module last wrote it
        self._device_nodes: dict[str, int | None] = {}  # a device's node does not change while it is there
        self._table = None
        self.sources: dict[str, SourceStatus] = {}

    def start(self, bpf, switch_attached: bool, nvml_attached: bool = True) -> list[SourceStatus]:
        """nvml_attached: NVML's process lists are there to give processes a home."""
        self.nodes = nodes(self.sysfs_root)
        if not switch_attached:
            st = SourceStatus("numa", "disabled", "needs the sched_switch probe")
        elif not self.nodes:
            st = SourceStatus("numa", "missing", "no NUMA nodes in sysfs (CONFIG_NUMA off)")
        else:
            self._table = bpf[b"numa_home"]
            n = f"{len(self.nodes)} node{'s' if len(self.nodes) > 1 else ''}"
            st = SourceStatus("numa", "attached", n if nvml_attached else
                              f"{n}; no GPU process list (NVML missing): CPU time is counted, its locality unknown")
        self.sources = {st.name: st}
        return [st]

    def node_of(self, bdf: str | None) -> int | None:
        if bdf not in self._device_nodes:
            self._device_nodes[bdf] = device_node(bdf, self.nodes, self.sysfs_root)
        return self._device_nodes[bdf]

    def tick(self) -> None:
        """numa_home := the homes of the processes NVML lists now. The kernel drops an exiting
        process's entry itself; a pid NVML stopped listing is dropped here. Every home is written
        again each tick (GPU processes are few): a pid reused since is not left without one."""
        if self._table is None:
            return
        # NVML's list lags an exit by up to a sample: a pid no longer in /proc is not written back
        # (the kernel dropped its entry at the exit), nor left to a process that reuses it
        want = {pid: node for pid, node in home_nodes(self.gpu_processes(), self.node_of).items()
                if os.path.exists(f"{self.proc_root}/{pid}")}
        for pid in [p for p in self.homes if p not in want]:
            try:
                del self._table[ctypes.c_uint32(pid)]
            except KeyError:  # gone with its process (sched_process_exit)
                pass
            del self.homes[pid]
        failed = None
        for pid, node in want.items():
            try:
                self._table[ctypes.c_uint32(pid)] = ctypes.c_uint32(node)
            except Exception as e:  # noqa: BLE001 -- numa_home full (E2BIG): the others still go in
                failed = e
                continue
            self.homes[pid] = node
        if failed is not None:
            raise failed  # counted once in hostagent.agent.errors{numa} by the tick step

    def evidence(self, fr) -> Evidence:
        node = self.homes.get(fr.tgid)
        return NONE if node is None else Evidence({HOME_NODE: node})
