"""NUMA locality of GPU processes' CPU time (bpf/numa.bpf.c, through requests.bpf.c's slice hook)."""

from ..core.capability import Declaration


def _make():
    from .capability import Numa
    return Numa


CAPABILITY = Declaration(
    name="numa", make=_make, bpf="numa.bpf.c", hooks={"slice": "numa_slice", "process_exit": "numa_gone"},
    needs=("gpu.processes", "gpu.nvml_attached"),
    attributes=("hostagent.numa.home_node", "hostagent.numa.remote.time", "hostagent.numa.remote.ratio"),
)
