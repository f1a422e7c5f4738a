"""NVLink through NVML (agent/gpuhealth/nvlink.py): the H200's own answers (no NVLink: every call
NOT_SUPPORTED, asked once), and link states and error counters other owners published from real
GPUs (tests/fixtures/gpu/nvlink_public.json), replayed through the sampler as NVML would give them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pynvml
import pytest

from nvml_replay import FIXTURES, ReplayNvml
from mcp_hostagent.gpuhealth import telemetry as GT
from mcp_hostagent.gpuhealth.nvml import NvmlSampler, aggregate_samples

H200 = json.loads((FIXTURES / "nvlink_numa_h200.json").read_text())
PUBLIC = json.loads((FIXTURES / "nvlink_public.json").read_text())["gpus"]
NOT_SUPPORTED, INVALID_ARGUMENT = 3, 2
COUNTERS = {pynvml.NVML_NVLINK_ERROR_DL_REPLAY: "replay", pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery",
            pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc_flit", pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA: "crc_data"}


class NvLinkReplay(ReplayNvml):
    """The H200's recorded samples for everything else; NVLink answers from `gpu` (a public frame:
    state list, errors) or, with h200=True, the H200's recorded per-link errors."""

    def __init__(self, gpu: dict | None = None, h200: bool = False):
        super().__init__()
        self.frame, self.h200 = gpu, h200
        self.NVML_NVLINK_MAX_LINKS = H200["max_links"] if h200 else 18  # the binding's constant: 36 in nvidia-ml-py 13

    def nvmlDeviceGetNvLinkState(self, h, link):
        self.log.append((0.0, "nvmlDeviceGetNvLinkState", h.index))
        if self.h200:
            raise pynvml.NVMLError(H200["gpus"][0]["links"][link]["state"]["error"])
        if link >= len(self.frame["state"]):
            raise pynvml.NVMLError(INVALID_ARGUMENT)
        return self.frame["state"][link]

    def nvmlDeviceGetNvLinkErrorCounter(self, h, link, counter):
        self.log.append((0.0, "nvmlDeviceGetNvLinkErrorCounter", h.index))
        name = COUNTERS[counter]
        if self.h200:
            raise pynvml.NVMLError(H200["gpus"][0]["links"][link]["errors"][name]["error"])
        published = self.frame.get("errors", {}).get(name)
        if published is None:  # not published: what a counter a generation dropped answers
            raise pynvml.NVMLError(NOT_SUPPORTED)
        return published[link]


def metrics(sample) -> dict:
    gpu = SimpleNamespace(sampler=SimpleNamespace(snapshot=lambda: {0: sample}), xid=SimpleNamespace(counts={}))
    return {i.name: i.read() for i in GT.instruments(gpu) if i.name.startswith("hostagent.gpu.nvlink")}


def by(rows, key) -> dict:
    return {a[key]: v for v, a in rows}


def nvlink_calls(fake) -> int:
    return sum(1 for _, n, _ in fake.log if n.startswith("nvmlDeviceGetNvLink"))


def test_the_h200_has_no_nvlink_and_is_asked_once():
    fake = NvLinkReplay(h200=True)
    sampler = NvmlSampler(fake, slow_period_s=10)
    s = sampler.sample_once()[0]
    assert s.up and s.nvlink is None and s.pcie_tx_kbytes_s is not None  # throughput unaffected
    assert nvlink_calls(fake) == H200["max_links"]  # every link's state NOT_SUPPORTED; no counter asked
    sampler.sample_once()
    assert nvlink_calls(fake) == H200["max_links"]  # not supported is not asked again
    assert metrics(s) == {"hostagent.gpu.nvlink.links": [], "hostagent.gpu.nvlink.links.down": [],
                          "hostagent.gpu.nvlink.errors": []}
    agg = aggregate_samples([s])
    assert not [k for k in agg.attributes() if ".nvlink." in k]


def test_gb200_all_links_up():
    s = NvmlSampler(NvLinkReplay(PUBLIC["gb200_all_up"]), slow_period_s=10).sample_once()[0]
    assert len(s.nvlink.links) == 18 and len(s.nvlink.active) == 18 and s.nvlink.down == ()
    m = metrics(s)
    assert by(m["hostagent.gpu.nvlink.links"], "hostagent.nvlink.state") == {"active": 18, "inactive": 0}
    assert [v for v, _ in m["hostagent.gpu.nvlink.links.down"]] == [0]


def test_gb300_error_counters_as_published():
    s = NvmlSampler(NvLinkReplay(PUBLIC["gb300_link0_errors"]), slow_period_s=10).sample_once()[0]
    m = metrics(s)
    assert by(m["hostagent.gpu.nvlink.errors"], "hostagent.nvlink.error.type") == {
        "replay": 0, "recovery": 0, "crc_flit": 0}  # crc_data: not published -> not supported -> absent


def test_a_board_without_a_bridge_is_inactive_not_down():
    """Every link disabled from the first sample on (A100 PCIe): no link is down."""
    sampler = NvmlSampler(NvLinkReplay(PUBLIC["a100_pcie_no_bridge"]), slow_period_s=10)
    s = sampler.sample_once()[0]
    assert len(s.nvlink.links) == 12 and s.nvlink.active == () and s.nvlink.down == ()
    m = metrics(s)
    assert by(m["hostagent.gpu.nvlink.links"], "hostagent.nvlink.state") == {"active": 0, "inactive": 12}
    assert [v for v, _ in m["hostagent.gpu.nvlink.links.down"]] == [0]


def test_links_that_go_inactive_are_down_and_reach_a_requests_gpu_attributes():
    """V100-SXM2: six links up, then links 3 and 5 inactive (the published state)."""
    fake = NvLinkReplay(PUBLIC["v100_sxm2_before"])
    sampler = NvmlSampler(fake, slow_period_s=10)
    before = sampler.sample_once()[0]
    assert before.nvlink.down == () and len(before.nvlink.active) == 6
    fake.frame = PUBLIC["v100_sxm2_two_inactive"]
    after = sampler.sample_once()[0]
    assert after.nvlink.active == (0, 1, 2, 4) and after.nvlink.down == (3, 5)
    m = metrics(after)
    assert by(m["hostagent.gpu.nvlink.links"], "hostagent.nvlink.state") == {"active": 4, "inactive": 2}
    assert [v for v, _ in m["hostagent.gpu.nvlink.links.down"]] == [2]
    attrs = aggregate_samples([before, after]).attributes()
    assert attrs["hostagent.gpu.nvlink.links.active.min"] == 4
    assert attrs["hostagent.gpu.nvlink.links.down.max"] == 2
    assert "hostagent.gpu.nvlink.errors" not in attrs  # no counter answered: unknown, not 0


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_links_past_the_gpus_last_answer_invalid_argument_and_are_skipped(name):
    s = NvmlSampler(NvLinkReplay(PUBLIC[name]), slow_period_s=10).sample_once()[0]
    assert s.up and len(s.nvlink.links) == len(PUBLIC[name]["state"])


def test_fast_samples_sharing_one_read_give_no_error_increase():
    """NVLink is read at the slow cadence; the fast samples between two reads carry the same read,
    so a request inside one read's span has no increase to report: unknown, not 0."""
    fake = NvLinkReplay(PUBLIC["gb300_link0_errors"])
    sampler = NvmlSampler(fake, slow_period_s=10)
    first = sampler.sample_once()[0]
    sampler.slow_period_ns = 0  # the next rounds fast only, as between two slow rounds
    fast = [sampler.sample_once()[0] for _ in range(3)]
    assert all(s.nvlink is first.nvlink for s in fast)
    assert "hostagent.gpu.nvlink.errors" not in aggregate_samples([first, *fast]).attributes()


def test_a_counter_or_state_that_fails_once_keeps_its_last_answer():
    fake = NvLinkReplay(PUBLIC["gb300_link0_errors"])
    sampler = NvmlSampler(fake, slow_period_s=10)
    a = sampler.sample_once()[0]

    def unknown(h, *args):  # an NVML error that is not "not supported": asked again next time
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    for name in ("nvmlDeviceGetNvLinkState", "nvmlDeviceGetNvLinkErrorCounter"):
        setattr(fake, name, (lambda orig: lambda h, *args: unknown(h))(getattr(fake, name)))
    b = sampler.sample_once()[0]
    assert b.nvlink.t_ns > a.nvlink.t_ns
    assert (b.nvlink.links, b.nvlink.active, b.nvlink.errors, b.nvlink.down) == \
        (a.nvlink.links, a.nvlink.active, a.nvlink.errors, ())  # no drop, no link down


def test_links_past_the_last_are_asked_once():
    fake = NvLinkReplay(PUBLIC["v100_sxm2_two_inactive"])
    sampler = NvmlSampler(fake, slow_period_s=10)
    sampler.sample_once()
    first = sum(1 for _, n, _ in fake.log if n == "nvmlDeviceGetNvLinkState")
    sampler.sample_once()
    second = sum(1 for _, n, _ in fake.log if n == "nvmlDeviceGetNvLinkState") - first
    assert first == 18 and second == 6  # 18: the binding's count; then the GPU's own six
