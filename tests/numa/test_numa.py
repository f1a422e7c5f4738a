"""NUMA homes: a GPU's node from sysfs (replayed from the H200's recording, and this machine's own
PCI devices), and which processes get a home."""

from __future__ import annotations

import json
import os
from pathlib import Path

from conftest import unstarted_agent
from mcp_hostagent.core.decode import Counters
from mcp_hostagent.core.topology import numa_nodes as nodes
from mcp_hostagent.numa.capability import (NUMA_REMOTE_RATIO, NUMA_REMOTE_TIME, cpu_rows as numa_rows, device_node,
                                           home_nodes, remote_attributes)

H200 = json.loads((Path(__file__).parent.parent / "fixtures" / "gpu" / "nvlink_numa_h200.json").read_text())


def sysfs(tmp_path, node_names, devices: dict[str, str]) -> str:
    """A sysfs tree with the node directories and each device's numa_node file, as recorded."""
    for n in node_names:
        (tmp_path / "devices" / "system" / "node" / n).mkdir(parents=True)
    for bdf, value in devices.items():
        d = tmp_path / "bus" / "pci" / "devices" / bdf
        d.mkdir(parents=True)
        (d / "numa_node").write_text(value + "\n")
    return str(tmp_path)


def h200_devices() -> dict[str, str]:
    return {g["busId"].lower()[-12:]: g["numa_node"] for g in H200["gpus"]}


def test_the_h200s_one_node_is_every_gpus_home(tmp_path):
    """The H200 VM: one node (node0, CPUs 0-15), the GPU's numa_node -1 (no ACPI proximity): every
    CPU is local, so node 0 is the home, not unknown."""
    root = sysfs(tmp_path, H200["nodes"], h200_devices())
    assert nodes(root) == {0}
    (bdf,) = h200_devices()
    assert device_node(bdf, {0}, root) == 0
    assert device_node(H200["gpus"][0]["busId"], {0}, root) == 0  # NVML's spelling of the address


def test_no_proximity_on_a_host_of_several_nodes_is_no_home(tmp_path):
    """The H200's -1 where two nodes exist: the GPU could be on either; no process gets a home."""
    root = sysfs(tmp_path, ["node0", "node1"], {**h200_devices(), "0000:41:00.0": "1", "0000:42:00.0": "7"})
    (bdf,) = h200_devices()
    assert device_node(bdf, {0, 1}, root) is None
    assert device_node("0000:41:00.0", {0, 1}, root) == 1
    assert device_node("0000:42:00.0", {0, 1}, root) is None  # a node that is not the host's
    assert device_node("0000:99:00.0", {0, 1}, root) is None  # no such device
    assert device_node(None, {0, 1}, root) is None


def test_this_machines_pci_devices_agree_with_sysfs():
    host = nodes()
    devs = sorted(os.listdir("/sys/bus/pci/devices"))
    assert devs, "no PCI devices in /sys"
    for bdf in devs:
        raw = int(open(f"/sys/bus/pci/devices/{bdf}/numa_node").read())
        want = next(iter(host)) if len(host) == 1 else (raw if raw in host else None)
        assert device_node(bdf, host) == want, bdf


def test_home_only_where_all_of_a_process_gpus_share_a_node():
    node = {"a": 0, "b": 0, "c": 1, "d": None}.get
    homes = home_nodes({10: {"a"}, 11: {"a", "b"}, 12: {"a", "c"}, 13: {"d"}, 14: {"c"}, 15: {"a", "d"}}, node)
    assert homes == {10: 0, 11: 0, 14: 1}


def test_numa_is_reported_off_without_the_switch_probe(tmp_path):
    n = unstarted_agent(sysfs_root=sysfs(tmp_path, H200["nodes"], {})).caps["numa"]
    (st,) = n.start()  # not started: sched_switch not attached
    assert st.state == "disabled" and "sched_switch" in st.reason
    n.tick()  # nothing to write to


def test_remote_share_only_with_a_home():
    """A measured 0 when the process had a home, absent (never a false 0) when it had none."""
    s = 1_000_000_000
    homed = remote_attributes(Counters(oncpu_ns=2 * s, oncpu_homed_ns=2 * s, oncpu_remote_ns=0))
    assert homed[NUMA_REMOTE_TIME] == 0 and homed[NUMA_REMOTE_RATIO] == 0
    part = remote_attributes(Counters(oncpu_ns=4 * s, oncpu_homed_ns=2 * s, oncpu_remote_ns=s // 2))
    assert part[NUMA_REMOTE_RATIO] == 0.25 and part[NUMA_REMOTE_TIME] == 0.5
    none = remote_attributes(Counters(oncpu_ns=2 * s))
    assert NUMA_REMOTE_TIME not in none and NUMA_REMOTE_RATIO not in none


def test_process_rows_by_locality():
    s = 1_000_000_000
    rows = {a["hostagent.numa.locality"]: v for v, a in numa_rows(Counters(oncpu_ns=4 * s, oncpu_homed_ns=3 * s,
                                                                            oncpu_remote_ns=s))}
    assert rows == {"local": 2.0, "remote": 1.0, "unknown": 1.0}
    rows = {a["hostagent.numa.locality"]: v for v, a in numa_rows(Counters(oncpu_ns=2 * s))}
    assert rows == {"unknown": 2.0}
    assert numa_rows(Counters()) == []


def test_exported_locality_never_goes_backwards(tmp_path):
    """The kernel adds a slice to homed, then to remote: a read between the two sees local one slice
    high, and the next read one slice lower. The exported counter holds its highest value."""
    agent = unstarted_agent(proc_root=str(tmp_path))
    procs = agent.processes
    attrs = {"process.pid": 10, "process.executable.name": "srv", "process.creation.time": "t0"}
    (inst,) = [i for i in agent.caps["numa"].instruments() if i.name == "hostagent.process.numa.cpu.time"]

    def local_after(homed, remote):
        procs.set_rows({10: (attrs, Counters(oncpu_ns=homed, oncpu_homed_ns=homed, oncpu_remote_ns=remote))}, {})
        return {a["hostagent.numa.locality"]: v for v, a in inst.read()}["local"]

    assert local_after(7_000, 1_000) == 6e-6  # torn: homed has the slice, remote not yet
    assert local_after(7_000, 2_000) == 6e-6  # remote caught up: local held, not 5e-6
    assert local_after(9_000, 2_000) == 7e-6
