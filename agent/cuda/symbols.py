"""The driver API symbols the CUDA probes hook (bpf/cuda.bpf.c's uprobe programs), and each one's
state in one libcuda file.

SYMBOLS names every libcuda.so export that is probed: its probe row (cuda/__init__.py), the
BPF function run at entry and, for the latency pairs, at return. The cuLaunchKernel* ones (DUTY_PROBE)
are the high-rate ones the governor duty-cycles: their entry functions are also the counter fields
(LAUNCH_FIELDS) and the weight slots in cu_config (LAUNCH_CFG).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core import probes as P
from . import uprobes
from .records import C

LAUNCH_FIELDS = ("cu_launch", "cu_launch_ptsz", "cu_launch_ex", "cu_launch_ex_ptsz")
# every launch call counted, kernels and graph replays (a replay is one call, however many kernels)
LAUNCH_CALLS = LAUNCH_FIELDS + ("cu_graph_launch",)


@dataclass(frozen=True)
class Sym:
    name: str
    probe: str  # its probe row (cuda/__init__.py)
    entry: str  # BPF function run at entry
    ret: str | None = None  # BPF function run at return (latency pairs)


SYMBOLS = (
    # entry function = counter field = weight slot of the duty-cycled ones (LAUNCH_CFG)
    Sym("cuLaunchKernel", "cuda_launch", "cu_launch"),
    Sym("cuLaunchKernel_ptsz", "cuda_launch", "cu_launch_ptsz"),
    Sym("cuLaunchKernelEx", "cuda_launch", "cu_launch_ex"),  # cuBLAS launches through it
    Sym("cuLaunchKernelEx_ptsz", "cuda_launch", "cu_launch_ex_ptsz"),
    Sym("cuGraphLaunch", "cuda_graph", "cu_graph_launch"),  # one per replay, not per kernel
    Sym("cuGraphLaunch_ptsz", "cuda_graph", "cu_graph_launch"),
    Sym("cuCtxPushCurrent", "cuda_ctx", "cu_ctx_enter", "cu_ctx_ret"),
    Sym("cuCtxPushCurrent_v2", "cuda_ctx", "cu_ctx_enter", "cu_ctx_ret"),
    Sym("cuCtxPopCurrent", "cuda_ctx", "cu_ctx_enter", "cu_ctx_ret"),
    Sym("cuCtxPopCurrent_v2", "cuda_ctx", "cu_ctx_enter", "cu_ctx_ret"),
    Sym("cuCtxSetCurrent", "cuda_ctx", "cu_ctx_enter", "cu_ctx_ret"),
    Sym("cuStreamSynchronize", "cuda_sync", "cu_sync_stream_enter", "cu_sync_ret"),
    Sym("cuStreamSynchronize_ptsz", "cuda_sync", "cu_sync_stream_enter", "cu_sync_ret"),
    Sym("cuCtxSynchronize", "cuda_sync", "cu_sync_ctx_enter", "cu_sync_ret"),
    Sym("cuCtxSynchronize_v2", "cuda_sync", "cu_sync_ctx_enter", "cu_sync_ret"),  # driver 580 exports it
    Sym("cuEventSynchronize", "cuda_sync", "cu_sync_event_enter", "cu_sync_ret"),
    Sym("cuMemAlloc_v2", "cuda_alloc", "cu_alloc_enter", "cu_alloc_ret"),
    Sym("cuMemAllocAsync", "cuda_alloc", "cu_alloc_enter", "cu_alloc_ret"),
    Sym("cuMemAllocAsync_ptsz", "cuda_alloc", "cu_alloc_enter", "cu_alloc_ret"),
    Sym("cuMemFree_v2", "cuda_free", "cu_free_enter", "cu_free_ret"),
    Sym("cuMemFreeAsync", "cuda_free", "cu_free_enter", "cu_free_ret"),  # the stream-ordered allocator's
    Sym("cuMemFreeAsync_ptsz", "cuda_free", "cu_free_enter", "cu_free_ret"),
)
DUTY_PROBE = "cuda_launch"  # the high-rate ones; the rest are a few per step
LAUNCH_CFG = {f: C["MCP_CFG_WEIGHT_" + f[3:].upper()] for f in LAUNCH_FIELDS}
UPROBE_ROWS = tuple(dict.fromkeys(s.probe for s in SYMBOLS))


@dataclass
class SymState:
    """One symbol in one libcuda file: its address, state, uprobes and the duty cycle's credit."""
    sym: Sym
    addr: int | None = None
    state: str = "pending"  # attached | missing | alias | disabled
    reason: str = ""
    events: list[uprobes.Handle] = field(default_factory=list)  # entry (and return) uprobe, while attached
    on_since: float | None = None
    attached_s: float = 0.0  # cumulative, for reporting
    credit: float = 0.0  # duty cycle: on-time owed (s)
    last_t: float = 0.0


WAITING_DETAIL = "no libcuda.so mapped now: armed per library inode as processes map it"


def family_status(row: str, libs: list[list[SymState]], attaching: bool = True, weight: int = 1,
                  paused: bool = False) -> tuple[str, str]:
    """One uprobe family's (probe row's) state and detail (core/probes.py names the states), from its
    symbols' states in each libcuda file followed (libs: per file, the row's SymStates). Armed only
    where a symbol is attached (for cuda_launch: on the duty cycler's list); symbols resolved but not
    attached (attaching False: `mcp-agent probes`) are found; no file at all is waiting."""
    if not libs:
        return P.WAITING, WAITING_DETAIL
    misses = sorted({s.reason for sts in libs for s in sts if s.state == "missing"})
    armed = sum(1 for sts in libs if any(s.state == "attached" for s in sts))
    found = sum(1 for sts in libs if any(s.state in ("attached", "found") for s in sts))
    tail = f"; {'; '.join(misses)}" if misses else ""
    if armed:
        detail = f"armed in {armed} of {len(libs)} libcuda file(s)" + tail
        if row == DUTY_PROBE and paused:
            return P.PAUSED, detail + "; launch probes detached for now (paused)"
        if row == DUTY_PROBE and weight > 1:
            return P.DUTY_CYCLED, detail + f"; attached one slice in {weight}: process counts scaled, request counts exact or labelled"
        return P.ARMED, detail
    if found and not attaching:
        return P.FOUND, (f"symbols found in {found} of {len(libs)} libcuda file(s); not attached by "
                         f"`mcp-agent probes` (`run` arms them)" + tail)
    return P.MISSING, f"{len(libs)} libcuda file(s), none armed" + tail
