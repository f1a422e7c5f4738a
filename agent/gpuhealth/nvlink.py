"""NVLink through NVML: each link's state and its data-link error counters, read on the GPU's own
sampler thread at the slow cadence (gpu.slow_period_s), next to PCIe throughput.

What NVML answers (nvml.h, driver 535-580): nvmlDeviceGetNvLinkState(link) -> NVML_FEATURE_ENABLED
(1) for a link that is up, DISABLED (0) for one that is down or has no peer; NOT_SUPPORTED on a GPU
without NVLink (the H200 VM: tests/fixtures/gpu/nvlink_numa_h200.json); INVALID_ARGUMENT past the
GPU's last link. nvmlDeviceGetNvLinkErrorCounter(link, counter) for the data-link layer's replay,
recovery and CRC counters (cumulative since the driver loaded; NOT_SUPPORTED for those a generation
dropped).

A PCIe board without an NVLink bridge reports every link disabled (NVIDIA/NVSentinel#1481: "link N is
currently down" for all 12 links of an A100 PCIe), so a disabled link is not by itself a fault: a link
is *down* when this agent saw it active on that GPU before (links_down, per sample).
"""

from __future__ import annotations

from dataclasses import dataclass

ENABLED = 1  # NVML_FEATURE_ENABLED
# nvmlNvLinkErrorCounter_t: NVML_NVLINK_ERROR_DL_REPLAY .. _DL_CRC_DATA
ERRORS = (("replay", 0), ("recovery", 1), ("crc_flit", 2), ("crc_data", 3))
MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS of nvml.h 535-575, where the binding has no constant


@dataclass(frozen=True)
class NvLinkState:
    links: tuple[int, ...]  # the links that answered a state
    active: tuple[int, ...]  # of those, the ones up
    errors: tuple[tuple[str, int], ...] = ()  # counter -> its sum over the links that answer it
    down: tuple[int, ...] = ()  # links this agent saw active on the GPU that are not now


def read(ask, max_links: int, seen_active: set[int]) -> NvLinkState | None:
    """ask(name, *args, variant=...) -> the GPU's NVML answer, or None for not supported, an invalid
    link or an error. None: no link answered (no NVLink). seen_active: the links seen up before on
    this GPU; updated."""
    states = {}
    for link in range(max_links):
        st = ask("nvmlDeviceGetNvLinkState", link, variant=f"link{link}")
        if st is not None:
            states[link] = int(st) == ENABLED
    if not states:
        return None
    active = tuple(sorted(k for k, up in states.items() if up))
    seen_active.update(active)
    errors = []
    for name, counter in ERRORS:
        got = [ask("nvmlDeviceGetNvLinkErrorCounter", link, counter, variant=f"{name}/link{link}") for link in states]
        got = [int(v) for v in got if v is not None]
        if got:
            errors.append((name, sum(got)))
    return NvLinkState(tuple(sorted(states)), active, tuple(errors),
                       tuple(sorted(k for k in seen_active if not states.get(k, False))))
