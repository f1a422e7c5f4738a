"""bpf/cuda.h mirrored: constants read from it, structs as ctypes (tests/core/test_layout.py), and the
span attributes of the counters bpf/cuda.bpf.c keeps per request and per process."""

from __future__ import annotations

import ctypes

from ..core import records as R
from ..core.records import Hdr, u16, u32, u64

C = R.header_constants("cuda.h")

# struct mcp_counters field -> request span attribute (docs/TELEMETRY.md). The launch counts of a
# window where a launch probe was duty-cycled are replaced by this capability's evidence: an estimate
# with its coverage, or left off (unknown), never a false 0 (cuda/telemetry.py coverage_attributes).
COUNTERS = {
    "cu_launch": "hostagent.cuda.launches.cuLaunchKernel",
    "cu_launch_ptsz": "hostagent.cuda.launches.cuLaunchKernel_ptsz",
    "cu_launch_ex": "hostagent.cuda.launches.cuLaunchKernelEx",
    "cu_launch_ex_ptsz": "hostagent.cuda.launches.cuLaunchKernelEx_ptsz",
    "cu_graph_launch": "hostagent.cuda.graph_launches",
    "cu_ctx_ops": "hostagent.cuda.ctx.count",
    "cu_ctx_ns": "hostagent.cuda.ctx.time",
    "cu_syncs": "hostagent.cuda.sync.count",
    "cu_sync_ns": "hostagent.cuda.sync.time",
    "cu_allocs": "hostagent.cuda.alloc.count",
    "cu_alloc_ns": "hostagent.cuda.alloc.time",
    "cu_frees": "hostagent.cuda.free.count",
    "cu_free_ns": "hostagent.cuda.free.time",
    "nv_ioctls": "hostagent.nvidia.ioctl.count",
    "nv_ioctl_ns": "hostagent.nvidia.ioctl.time",
    "sampled": "hostagent.cuda.sampled",
    "cu_alloc_oom": "hostagent.cuda.alloc.out_of_memory",
}


class CuPendKey(ctypes.Structure):
    _fields_ = [("tid", u32), ("family", u32)]


class CuPend(ctypes.Structure):
    _fields_ = [("ts_ns", u64), ("kind", u32), ("pad", u32)]


class CuThread(ctypes.Structure):
    _fields_ = [("step_begin_ns", u64), ("tgid", u32), ("pad", u32), ("c", R.Counters)]


class HistKey(ctypes.Structure):
    _fields_ = [("tgid", u32), ("kind", u16), ("slot", u16)]


class NvFdKey(ctypes.Structure):
    _fields_ = [("tgid", u32), ("fd", u32)]


class NvIoctlStart(ctypes.Structure):
    _fields_ = [("ts_ns", u64), ("cmd", u32), ("dev", u32)]


class NvCmdKey(ctypes.Structure):
    _fields_ = [("tgid", u32), ("cmd", u32), ("dev", u32), ("pad", u32)]


class NvCmdVal(ctypes.Structure):
    _fields_ = [("count", u64), ("ns", u64)]


class EvGpuStep(ctypes.Structure):
    _fields_ = [("h", Hdr), ("begin_ns", u64), ("sync_ns", u64), ("sync_kind", u32), ("pad", u32), ("c", R.Counters)]


STRUCTS = {
    "mcp_cu_pend_key": CuPendKey,
    "mcp_cu_pend": CuPend,
    "mcp_cu_thread": CuThread,
    "mcp_hist_key": HistKey,
    "mcp_nv_fd_key": NvFdKey,
    "mcp_nv_ioctl_start": NvIoctlStart,
    "mcp_nv_cmd_key": NvCmdKey,
    "mcp_nv_cmd_val": NvCmdVal,
    "mcp_ev_gpu_step": EvGpuStep,
}

SYNC_KINDS = {C["MCP_CU_SYNC_STREAM"]: "stream", C["MCP_CU_SYNC_CTX"]: "ctx", C["MCP_CU_SYNC_EVENT"]: "event"}
HIST_KINDS = {C["MCP_HIST_CTX"]: "ctx", C["MCP_HIST_SYNC"]: "sync", C["MCP_HIST_IOCTL"]: "ioctl",
              C["MCP_HIST_ALLOC"]: "alloc", C["MCP_HIST_FREE"]: "free"}
