"""GPU health: NVML samples, NVLink, Xid errors (bpf/gpuhealth.bpf.c: nvidia:nvidia_dev_xid)."""

from ..core.capability import Declaration, RawKind
from ..core.probes import ProbeSpec
from ..core.records import header_constants
from .xid import NVIDIA_DEV_XID_FORMAT, decode_xid

C = header_constants("gpuhealth.h")


def _make():
    from .capability import GpuHealth
    return GpuHealth


CAPABILITY = Declaration(
    name="gpuhealth", make=_make, bpf="gpuhealth.bpf.c", header="gpuhealth.h",
    attributes=("hostagent.gpu.*",),
    provides=("gpu.util_by_bdf", "gpu.gpus_of", "gpu.processes", "gpu.links", "gpu.nvml_attached"),
    raw={C["MCP_TP_NVIDIA_DEV_XID"]: RawKind("nvidia/nvidia_dev_xid", NVIDIA_DEV_XID_FORMAT, decode_xid)},
    imports=lambda cfg: ("pynvml",) if cfg.gpu_enabled else (),
    probes=(
        ProbeSpec("gpu_xid", "nvidia:nvidia_dev_xid", "gpuhealth.bpf.c",
                  "Xid errors from the NVIDIA driver, by GPU and code (NVML Xid events are the fallback)",
                  "the NVIDIA driver registers it when its module loads (driver 580 has it); "
                  "start the agent after the driver", kind="tracepoint_raw",
                  absent="no nvidia:nvidia_dev_xid (NVIDIA driver module not loaded, or a driver without it)"),
    ),
)
