"""Marked requests: the windows serving threads mark with the request marker (bpf/requests.bpf.c), and
the counters every family adds to a request, its thread, its process and its serving group."""

from ..core.capability import Declaration
from ..core.probes import ProbeSpec
from . import records


def _make():
    from .capability import Requests
    return Requests


CAPABILITY = Declaration(
    name="requests", make=_make, bpf="requests.bpf.c", header="requests.h", structs=records.STRUCTS, settings=records.bpf_settings,
    counters=records.COUNTERS, always=records.ALWAYS_SHOWN, provides=("requests.tree_root",), rings=(b"req_events",),
    probes=(
        ProbeSpec("marker", "syscalls:sys_enter_ioctl", "requests.bpf.c",
                  "request begin/end markers (per-request counters need it)",
                  "needs CONFIG_FTRACE_SYSCALLS"),
        ProbeSpec("page_faults", "exceptions:page_fault_user", "requests.bpf.c",
                  "user page faults per request and per process",
                  "x86 kernels have it; other architectures lack exceptions:* tracepoints"),
        ProbeSpec("sched_switch", "sched:sched_switch", "requests.bpf.c",
                  "context switches, off- and on-CPU time (by NUMA node) per request and per process",
                  "needs tracepoints (CONFIG_TRACEPOINTS)"),
        ProbeSpec("sched_wakeup", "sched:sched_wakeup", "requests.bpf.c",
                  "run-queue latency: wake-up to running, per request, process and serving group",
                  "needs tracepoints (CONFIG_TRACEPOINTS)"),
        ProbeSpec("page_cache", "filemap:mm_filemap_add_to_page_cache", "requests.bpf.c",
                  "bytes added to the page cache per request and process: reads and file faults the cache missed"
                  " (a model loading from disk), and new pages of buffered writes",
                  "needs the filemap events (CONFIG_TRACEPOINTS)"),
        ProbeSpec("watch_fork", "task:task_newtask", "requests.bpf.c",
                  "a watched process's children are watched from their first instruction (pre-fork workers);"
                  " requests.group = tree: they join its serving tree",
                  "needs tracepoints (CONFIG_TRACEPOINTS); without it, children wait for the watch scan"),
        ProbeSpec("process_exec", "sched:sched_process_exec", "requests.bpf.c",
                  "a program exec'd under a process.comms name is watched from its first syscall; the"
                  " capabilities' process_exec hooks (prompt libcuda rescans of processes that exec)",
                  "without it, such programs wait for the watch scan, and new libcuda inodes for a periodic scan"),
        ProbeSpec("process_exit", "sched:sched_process_exit", "requests.bpf.c",
                  "closes requests of threads that exit inside them; frees per-process state (the"
                  " capabilities' process_exit hooks)",
                  "without it, open requests end by idle expiry only"),
    ),
)
