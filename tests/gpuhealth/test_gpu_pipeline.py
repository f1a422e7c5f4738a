"""GPU and link health through the real pipeline: NVML replayed from the H200 recording
(tests/fixtures/gpu), the recorded sysfs PCI tree, real BPF for the request itself.

The replay only answers with values NVML returned on the H200; the one thing the test changes is
the pid in the recorded compute-process list (the recorded torch pid, 476, becomes our child's), so
that the agent's pid -> GPU join has a live process to find."""

from __future__ import annotations

import os
import time

import pytest

from nvml_replay import ReplayNvml, load, ns
from test_bpf_requests import TP, Child
from test_pcie import gpu_dir, set_link, sysroot  # noqa: F401  (fixture)

pytestmark = pytest.mark.bpf

GPU = "0000:00:06.0"


def busy_replay(pid: int) -> ReplayNvml:
    stream = load("nvml_stream.json")
    busy = [s for s in stream["samples"]
            if s["gpus"][0]["calls"]["nvmlDeviceGetComputeRunningProcesses"].get("value")]
    assert busy, "the recording has no busy samples"
    replay = ReplayNvml(stream=dict(stream, samples=busy))

    def procs(handle):
        recorded = replay.recorded(handle.index, "nvmlDeviceGetComputeRunningProcesses")
        for p in recorded:
            p.pid = pid
        return recorded

    replay.hooks[("nvmlDeviceGetComputeRunningProcesses", 0)] = procs
    return replay, busy


def test_request_span_carries_gpu_samples_and_link_episode(make_agent, sysroot):  # noqa: F811
    child = Child()
    try:
        child.do("spin 1")
        replay, busy = busy_replay(child.pid)
        a = make_agent(agent_kwargs={"nvml_module": replay, "sysfs_root": str(sysroot)},
                       gpu__sample_period_s=0.1, nic__enabled=False)
        assert a.agent.caps["gpuhealth"].sources["nvml"].state == "attached"
        assert a.agent.caps["pcie"].sources["pcie_sysfs"].state == "attached"
        deadline = time.monotonic() + 5
        while not a.agent.caps["gpuhealth"].gpus_of(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.agent.caps["gpuhealth"].gpus_of(child.pid) == {0: GPU}
        child.do(f"begin 301 {TP}", "spin 400")
        set_link(gpu_dir(sysroot), width="8")  # a narrower width is degradation, busy or idle
        deadline = time.monotonic() + 5
        while not a.agent.caps["pcie"].links.episodes and time.monotonic() < deadline:
            time.sleep(0.05)
        child.do("spin 300", "end 301")
        (span,) = a.wait_spans(1, **{"process.pid": child.pid, "hostagent.request.id": f"{301:016x}"})
        attrs = span.attributes
        recorded_util = {s["gpus"][0]["calls"]["nvmlDeviceGetUtilizationRates"]["value"]["gpu"] for s in busy}
        assert attrs["hostagent.gpu.pci_bus_id"] == GPU
        assert attrs["hostagent.gpu.uuid"] == replay.static(0, "nvmlDeviceGetUUID")
        # NVML's percent as a ratio (rounded to 4 places, as GpuAggregate.attributes exports it)
        assert attrs["hostagent.gpu.utilization.max"] in {round(u / 100, 4) for u in recorded_util}
        assert round(min(recorded_util) / 100, 4) <= attrs["hostagent.gpu.utilization.mean"] <= round(max(recorded_util) / 100, 4)
        assert attrs["hostagent.gpu.samples"] >= 2
        links = [l for l in span.links if l.attributes["hostagent.link.type"] == "pcie_link_episode"]
        assert links and links[0].attributes["hostagent.pcie.gpu_bdf"] == GPU
        assert any(e.name == "hostagent.pcie.link_episode" for e in span.events)
    finally:
        child.close()
    set_link(gpu_dir(sysroot), width="16")  # retrained: the episode closes and its span is exported
    ep = None
    deadline = time.monotonic() + 5
    while ep is None and time.monotonic() < deadline:
        ep = next((s for s in a.spans() if s.name == "hostagent.pcie.link_episode"), None)
        time.sleep(0.1)
    assert ep is not None and ep.context.span_id == links[0].context.span_id
    assert ep.attributes["hostagent.pcie.causes"] == ("width_drop",)
    assert (ep.attributes["hostagent.pcie.from_width"], ep.attributes["hostagent.pcie.to_width"]) in {(16, 8), (16, 16)}
