"""NUMA locality: how much of a GPU process's CPU time runs on a node other than its GPUs'.

A serving thread on a remote node pays for every host-device copy and every page it touches
across the socket interconnect. The kernel side (bpf/numa.bpf.c, run by the slice hook of
requests.bpf.c's sched_switch) splits each traced thread's on-CPU slice by the node it ran on
(bpf_get_numa_node_id()) against the process's home node in the map numa_home; this module keeps that
map: a process's home is the node of the GPUs NVML lists it on, when they share one. The counters
(oncpu_homed_ns, oncpu_remote_ns) become a request's remote share here (evidence) and each process's
CPU time by locality (instruments).

A GPU's node is its PCI device's numa_node in sysfs (drivers/pci/pci-sysfs.c), -1 when the
firmware gives no proximity. On a host with one node, every CPU is local whatever that says; on
several, a -1 leaves the process without a home: its time counts as on-CPU only, never as local.
"""

from __future__ import annotations

import ctypes
import os

from ..core.capability import Capability, Evidence, SourceStatus
from ..core.request import SCOPES, scoped
from ..core.topology import normalize_bdf, numa_nodes
from ..telemetry.spec import Instrument

HOME_NODE = "hostagent.numa.home_node"
NUMA_REMOTE_TIME = "hostagent.numa.remote.time"
NUMA_REMOTE_RATIO = "hostagent.numa.remote.ratio"


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


def remote_attributes(c) -> dict:
    """Remote time only where the process had a home node for some of the window: 0 then is a
    measured 0; without a home there is nothing to be remote from, and the attributes are absent."""
    if not c.oncpu_homed_ns:
        return {}
    return {NUMA_REMOTE_TIME: c.oncpu_remote_ns / 1e9, NUMA_REMOTE_RATIO: round(c.oncpu_remote_ns / c.oncpu_homed_ns, 4)}


def cpu_rows(c) -> list:
    """local and remote once the process had a home node (then a 0 is measured), unknown for the rest."""
    rows = []
    if c.oncpu_homed_ns:
        rows += [((c.oncpu_homed_ns - c.oncpu_remote_ns) / 1e9, {"hostagent.numa.locality": "local"}),
                 (c.oncpu_remote_ns / 1e9, {"hostagent.numa.locality": "remote"})]
    if c.oncpu_ns > c.oncpu_homed_ns:
        rows.append(((c.oncpu_ns - c.oncpu_homed_ns) / 1e9, {"hostagent.numa.locality": "unknown"}))
    return rows


class Numa(Capability):
    def __init__(self, ctx):
        super().__init__(ctx)
        # {pid: GPU PCI addresses it has contexts on} (gpuhealth)
        self.gpu_processes = ctx.inputs.get("gpu.processes", lambda: {})
        self.nvml_attached = ctx.inputs.get("gpu.nvml_attached", lambda: False)
        self.sysfs_root, self.proc_root = ctx.sysfs_root, ctx.proc_root
        self._cpu_last: dict[tuple, float] = {}  # (pid, start, locality) -> the value last exported
        self.nodes: set[int] = set()
        self.homes: dict[int, int] = {}  # what numa_home holds, as this module last wrote it
        self._device_nodes: dict[str, int | None] = {}  # a device's node does not change while it is there
        self._table = None
        self.sources: dict[str, SourceStatus] = {}

    def start(self) -> list[SourceStatus]:
        """With NVML's process lists there to give processes a home (gpu.nvml_attached)."""
        bpf, switch_attached, nvml_attached = self.ctx.bpf, self.ctx.attached("sched_switch"), self.nvml_attached()
        self.nodes = numa_nodes(self.sysfs_root)
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
        """The process's home node, and the share of the request's on-CPU time off it (the thread's,
        and a zero-code request's process and group)."""
        attrs = remote_attributes(fr.counters)
        for scope, counters in fr.scopes:
            if scope in SCOPES:
                attrs.update({scoped(k, scope): v for k, v in remote_attributes(counters).items()})
        node = self.homes.get(fr.tgid)
        if node is not None:
            attrs[HOME_NODE] = node
        return Evidence(attrs)

    def instruments(self) -> list:
        return [Instrument("hostagent.process.numa.cpu.time", "counter", "s",
                           "time the process's traced threads ran on a CPU, by NUMA locality to its GPUs' node "
                           "(local, remote; unknown while it had no home node: no GPU, or GPUs on several nodes)",
                           self._cpu_rows)]

    def _cpu_rows(self):
        """cpu_rows, never below what was exported before: the kernel adds a slice to its three
        counters one after the other, and a read between them would make local or unknown dip once
        (a counter reset to Prometheus). Called on the metric reader's thread only."""
        rows = self.ctx.processes.snapshot_rows()
        last, out = self._cpu_last, []
        for pid, (a, c) in rows:
            for v, extra in cpu_rows(c):
                key = (pid, a.get("process.creation.time"), extra["hostagent.numa.locality"])
                v = last[key] = max(v, last.get(key, 0.0))
                out.append((v, {**self.ctx.processes.metric_identity(a), **extra}))
        live = {pid for pid, _ in rows}
        for key in [k for k in last if k[0] not in live]:
            del last[key]
        return out
