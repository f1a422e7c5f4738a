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

from dataclasses import dataclass, field

ENABLED = 1  # NVML_FEATURE_ENABLED
# nvmlNvLinkErrorCounter_t: NVML_NVLINK_ERROR_DL_REPLAY .. _DL_CRC_DATA
ERRORS = (("replay", 0), ("recovery", 1), ("crc_flit", 2), ("crc_data", 3))
MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS of nvml.h 535-575, where the binding has no constant


@dataclass(frozen=True)
class NvLinkState:
    t_ns: int  # when it was read: samples between two reads share one
    links: tuple[int, ...]  # the links that answered a state (now or, for a call that failed now, before)
    active: tuple[int, ...]  # of those, the ones up
    errors: tuple[tuple[str, int], ...] = ()  # counter -> its sum over the links that answer it
    down: tuple[int, ...] = ()  # links this agent saw active on the GPU that are not now


@dataclass
class Memo:
    """One GPU's reads so far: a link or counter that fails once keeps its last answer (the totals
    must not drop), and links past the last that answered are not asked again."""
    seen_active: set[int] = field(default_factory=set)
    state: dict[int, bool] = field(default_factory=dict)
    errors: dict[tuple[str, int], int] = field(default_factory=dict)
    max_links: int | None = None


def read(ask, max_links: int, memo: Memo, t_ns: int) -> NvLinkState | None:
    """ask(name, *args, variant=...) -> the GPU's NVML answer, or None for not supported, an invalid
    link or an error. None: no link has answered a state (no NVLink)."""
    for link in range(memo.max_links if memo.max_links is not None else max_links):
        st = ask("nvmlDeviceGetNvLinkState", link, variant=f"link{link}")
        if st is not None:
            memo.state[link] = int(st) == ENABLED
    if not memo.state:
        return None
    memo.max_links = max(memo.state) + 1
    active = tuple(sorted(k for k, up in memo.state.items() if up))
    memo.seen_active.update(active)
    errors = []
    for name, counter in ERRORS:
        for link in memo.state:
            v = ask("nvmlDeviceGetNvLinkErrorCounter", link, counter, variant=f"{name}/link{link}")
            if v is not None:
                memo.errors[(name, link)] = int(v)
        got = [v for (n, _), v in memo.errors.items() if n == name]
        if got:
            errors.append((name, sum(got)))
    return NvLinkState(t_ns, tuple(sorted(memo.state)), active, tuple(errors),
                       tuple(sorted(k for k in memo.seen_active if not memo.state.get(k, False))))
