"""CUDA driver calls and NVIDIA ioctls (bpf/cuda.bpf.c): uprobes per libcuda inode, duty-cycled within
an overhead budget; per-request counts, zero-touch GPU steps, findings."""

from ..core.capability import Declaration
from ..core.probes import ProbeSpec
from . import records


def _make():
    from .capability import Cuda
    return Cuda


# The uprobe families are attached per libcuda inode by the capability (probeset.py), symbol by symbol,
# and so are the two tracepoint programs named apart from requests.bpf.c's ("tracepoint_fn")
CAPABILITY = Declaration(
    name="cuda", make=_make, bpf="cuda.bpf.c", header="cuda.h", structs=records.STRUCTS, counters=records.COUNTERS,
    hooks={"process_exec": "cuda_exec"}, needs=("requests.tree_root",), provides=("watch.libcuda_trusted",),
    attributes=("hostagent.finding.*", "hostagent.cuda.coverage.*", "hostagent.request.gpu_steps.*"),
    activity_stats=frozenset({"cu_launch_hits", "cu_auto_watch"}),
    probes=(
        ProbeSpec("cuda_launch", "uprobe:libcuda:cuLaunchKernel(_ptsz),cuLaunchKernelEx(_ptsz)", "cuda.bpf.c",
                  "kernel launches by symbol, per request and process (duty-cycled within the overhead budget)",
                  "needs uprobes (CONFIG_UPROBE_EVENTS)", kind="uprobe"),
        ProbeSpec("cuda_graph", "uprobe:libcuda:cuGraphLaunch(_ptsz)", "cuda.bpf.c",
                  "CUDA graph launches", "needs uprobes", kind="uprobe"),
        ProbeSpec("cuda_ctx", "uprobe:libcuda:cuCtxPushCurrent(_v2),cuCtxPopCurrent(_v2),cuCtxSetCurrent",
                  "cuda.bpf.c", "context switches: count, ns, latency histogram", "needs uprobes and uretprobes",
                  kind="uprobe"),
        ProbeSpec("cuda_sync", "uprobe:libcuda:cuStreamSynchronize(_ptsz),cuCtxSynchronize(_v2),cuEventSynchronize",
                  "cuda.bpf.c", "sync waits: count, ns, histogram; zero-touch GPU steps",
                  "needs uprobes and uretprobes", kind="uprobe"),
        ProbeSpec("cuda_alloc", "uprobe:libcuda:cuMemAlloc_v2,cuMemAllocAsync(_ptsz)", "cuda.bpf.c",
                  "device memory allocations: count, ns", "needs uprobes and uretprobes", kind="uprobe"),
        ProbeSpec("cuda_free", "uprobe:libcuda:cuMemFree_v2,cuMemFreeAsync(_ptsz)", "cuda.bpf.c",
                  "device memory frees: count, ns", "needs uprobes and uretprobes", kind="uprobe"),
        ProbeSpec("nvidia_ioctl", "syscalls:sys_enter_ioctl+sys_exit_ioctl", "cuda.bpf.c",
                  "ioctls on NVIDIA device fds: count, ns, by request code", "needs CONFIG_FTRACE_SYSCALLS",
                  kind="tracepoint_fn"),
        ProbeSpec("cuda_thread_exit", "sched:sched_process_exit", "cuda.bpf.c",
                  "drops pending CUDA call entries of threads that die inside a call",
                  "without it, stale entries age out by the sanity bound", kind="tracepoint_fn"),
    ),
)
