"""The probe table: every BPF hook the agent can attach, and what became of each on this host.

A probe is one tracepoint program in one BPF source. Before compiling, each probe is checked against
tracefs (bcc cannot compile a TRACEPOINT_PROBE whose format file is absent; a "tracepoint_raw" probe
compiles anywhere but has nothing to attach to, and says why from gpuhealth.tracepoints.MISSING_WHY); a probe that is
disabled, absent or fails to attach is reported with a reason and a hint, and the rest run
(`--strict` makes any miss fatal). Adding a probe is one row here and one #if block in its .c file.

States (`mcp-agent probes`, `run`'s start-up summary, the status line and the agent's probe-state gauge):
  attached      a tracepoint program attached
  missing       not attached, with the reason (and a hint)
  disabled      probes.disable names it
The libcuda uprobe families (kind "uprobe": cuda_launch ... cuda_free) are attached per library inode
as processes map libcuda.so (agent/cuda), so they have states of their own; none of them reads attached:
  armed         uprobes attached in N libcuda files (they fire in every process mapping those files)
  duty-cycled   cuda_launch armed, but the governor attaches it one slice in N (process counts
                scaled; a request's count exact, or labelled with its coverage)
  paused        cuda_launch armed, but its uprobes detached for now (CudaProbes.pause)
  waiting       compiled, no libcuda.so mapped now: armed when a process maps one
  found         `mcp-agent probes` only: symbols found in N libcuda files; that command attaches no uprobe
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..gpuhealth.tracepoints import MISSING_WHY
from .kernel import tracepoint_exists

ATTACHED, MISSING, DISABLED = "attached", "missing", "disabled"
ARMED, DUTY_CYCLED, PAUSED, WAITING, FOUND = "armed", "duty-cycled", "paused", "waiting", "found"
UPROBE_STATES = (ARMED, DUTY_CYCLED, PAUSED, WAITING, FOUND)  # the libcuda uprobe families' (agent/cuda)
LIVE = (ATTACHED, ARMED, DUTY_CYCLED)  # programs attached now (the status line's "probes N/M")


@dataclass(frozen=True)
class ProbeSpec:
    name: str
    tracepoint: str  # "category:event" (the hook, for other kinds: what it attaches to)
    program: str  # BPF source under bpf/ holding its #if MCP_PROBE_<NAME> block
    provides: str
    hint: str
    # the loader attaches "tracepoint" (bcc TRACEPOINT_PROBE) and "tracepoint_raw" (a plain function
    # that copies the record, decoded with the run-time format); other kinds are attached by their module
    kind: str = "tracepoint"
    fn: str = ""  # a plain function attached instead of the TRACEPOINT_PROBE (one program on several hooks)

    @property
    def macro(self) -> str:
        return "MCP_PROBE_" + self.name.upper().replace(".", "_")

    @property
    def fn_name(self) -> str:
        if self.fn:
            return self.fn
        prefix = "tp_raw__" if self.kind == "tracepoint_raw" else "tracepoint__"
        return prefix + self.tracepoint.replace(":", "__")


TRACEPOINT_KINDS = ("tracepoint", "tracepoint_raw")  # checked against tracefs, attached by the loader
# What the zero-code HTTP probes cannot see, said wherever they are listed (docs/HTTP.md: the plan)
HTTP_HINT = ("needs CONFIG_FTRACE_SYSCALLS; sees HTTP/1.1 in cleartext only: not TLS, HTTP/2, io_uring or"
             " sendfile (docs/HTTP.md)")


PROBES: tuple[ProbeSpec, ...] = (
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
              "a program exec'd under a process.comms name is watched from its first syscall; prompt libcuda"
              " rescans of processes that exec",
              "without it, such programs wait for the watch scan, and new libcuda inodes for a periodic scan"),
    ProbeSpec("process_exit", "sched:sched_process_exit", "requests.bpf.c",
              "closes requests of threads that exit inside them; frees per-process state",
              "without it, open requests end by idle expiry only"),
    ProbeSpec("reclaim_direct_begin", "vmscan:mm_vmscan_direct_reclaim_begin", "reclaim.bpf.c",
              "direct reclaim stall start, per thread", "needs CONFIG_TRACEPOINTS with vmscan events"),
    ProbeSpec("reclaim_direct_end", "vmscan:mm_vmscan_direct_reclaim_end", "reclaim.bpf.c",
              "direct reclaim stall ns and pages per request and process", "needs vmscan events"),
    ProbeSpec("reclaim_memcg_begin", "vmscan:mm_vmscan_memcg_reclaim_begin", "reclaim.bpf.c",
              "memcg (cgroup limit) reclaim stall start", "needs CONFIG_MEMCG"),
    ProbeSpec("reclaim_memcg_end", "vmscan:mm_vmscan_memcg_reclaim_end", "reclaim.bpf.c",
              "memcg reclaim stall ns and pages per request, process and cgroup", "needs CONFIG_MEMCG"),
    ProbeSpec("kswapd_wake", "vmscan:mm_vmscan_kswapd_wake", "reclaim.bpf.c",
              "kswapd active intervals per NUMA node (start)", "needs vmscan events"),
    ProbeSpec("kswapd_sleep", "vmscan:mm_vmscan_kswapd_sleep", "reclaim.bpf.c",
              "kswapd active intervals per NUMA node (end)", "needs vmscan events"),
    ProbeSpec("wakeup_kswapd", "vmscan:mm_vmscan_wakeup_kswapd", "reclaim.bpf.c",
              "which tasks' allocations woke kswapd", "needs vmscan events"),
    ProbeSpec("reclaim_shrink", "vmscan:mm_vmscan_lru_shrink_inactive", "reclaim.bpf.c",
              "pages scanned/reclaimed by kswapd, direct and memcg reclaim (cf. /proc/vmstat)",
              "needs vmscan events"),
    # zero-code HTTP/1.1 requests (http.bpf.c): socket syscalls of watched processes, no kprobes
    *(ProbeSpec(name, f"syscalls:{tp}", "http.bpf.c", provides, HTTP_HINT,
                fn="http_exit_read" if tp in ("sys_exit_read", "sys_exit_recvfrom") else
                "http_exit_write" if tp.startswith("sys_exit_") else "") for name, tp, provides in (
        ("http_read", "sys_enter_read", "zero-code HTTP requests: read() arguments of watched processes"),
        ("http_read_ret", "sys_exit_read", "zero-code HTTP requests: a request head read (begin), a peer's close"),
        ("http_recvfrom", "sys_enter_recvfrom", "zero-code HTTP requests: recv()/recvfrom() arguments"),
        ("http_recvfrom_ret", "sys_exit_recvfrom", "zero-code HTTP requests: a request head received (begin)"),
        ("http_write", "sys_enter_write", "zero-code HTTP responses: write() arguments inside a request"),
        ("http_write_ret", "sys_exit_write", "zero-code HTTP responses: head (status, framing), end"),
        ("http_sendto", "sys_enter_sendto", "zero-code HTTP responses: send()/sendto() arguments"),
        ("http_sendto_ret", "sys_exit_sendto", "zero-code HTTP responses: head (status, framing), end"),
        ("http_writev", "sys_enter_writev", "zero-code HTTP responses: writev() arguments (uvloop)"),
        ("http_writev_ret", "sys_exit_writev", "zero-code HTTP responses: head (status, framing), end"),
        ("http_sendmsg", "sys_enter_sendmsg", "zero-code HTTP responses: sendmsg() arguments (asyncio writelines)"),
        ("http_sendmsg_ret", "sys_exit_sendmsg", "zero-code HTTP responses: head (status, framing), end"),
        ("http_close", "sys_enter_close", "zero-code HTTP requests: a connection's close ends its open request"),
    )),
    ProbeSpec("http_sock_recv", "sock:sock_recv_length", "http.bpf.c",
              "zero-code HTTP requests: a read is a socket's (files and pipes make no record), and which socket",
              "Linux 6.3+ (include/trace/events/sock.h); without it agent/http checks each connection's fd in /proc"),
    ProbeSpec("http_sock_send", "sock:sock_send_length", "http.bpf.c",
              "zero-code HTTP responses: a write is a socket's, and which socket", "Linux 6.3+"),
    # CUDA driver and NVIDIA ioctls (cuda.bpf.c): uprobes per libcuda inode and the two tracepoint
    # programs named apart from requests.bpf.c's are attached by agent/cuda/capability.py, symbol by symbol.
    ProbeSpec("cuda_launch", "uprobe:libcuda:cuLaunchKernel(_ptsz),cuLaunchKernelEx(_ptsz)", "cuda.bpf.c",
              "kernel launches by symbol, per request and process (duty-cycled within the overhead budget)",
              "needs uprobes (CONFIG_UPROBE_EVENTS)", kind="uprobe"),
    ProbeSpec("cuda_graph", "uprobe:libcuda:cuGraphLaunch(_ptsz)", "cuda.bpf.c",
              "CUDA graph launches", "needs uprobes", kind="uprobe"),
    ProbeSpec("cuda_ctx", "uprobe:libcuda:cuCtxPushCurrent(_v2),cuCtxPopCurrent(_v2),cuCtxSetCurrent", "cuda.bpf.c",
              "context switches: count, ns, latency histogram", "needs uprobes and uretprobes", kind="uprobe"),
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
    # GPU and PCIe health (health.bpf.c): the record's bytes, decoded with the format tracefs gives at
    # run time (agent/gpuhealth/health_records.py), since these events come and go with the driver and kernel config.
    ProbeSpec("oom_kill", "oom:mark_victim", "health.bpf.c",
              "OOM kills, host and memcg: the victim, its RSS, the requests it ended or shared a cgroup with",
              "needs CONFIG_TRACEPOINTS (the oom events)", kind="tracepoint_raw"),
    ProbeSpec("gpu_xid", "nvidia:nvidia_dev_xid", "health.bpf.c",
              "Xid errors from the NVIDIA driver, by GPU and code (NVML Xid events are the fallback)",
              "the NVIDIA driver registers it when its module loads (driver 580 has it); "
              "start the agent after the driver", kind="tracepoint_raw"),
    ProbeSpec("pcie_aer", "ras:aer_event", "health.bpf.c",
              "PCIe AER errors as they are reported, into the link-episode judge (sysfs AER counters otherwise)",
              "needs CONFIG_PCIEAER and the PCIe port driver (CONFIG_PCIEPORTBUS)", kind="tracepoint_raw"),
    ProbeSpec("pcie_link_event", "pci:pcie_link_event", "health.bpf.c",
              "PCIe link speed/width changes: an immediate re-poll of the link (sysfs polling otherwise)",
              "a 2025 kernel tracepoint (include/trace/events/pci.h); older kernels rely on the poll",
              kind="tracepoint_raw"),
)


_HTTP_RX = ("http_read_ret", "http_recvfrom_ret")
_HTTP_TX = ("http_write_ret", "http_sendto_ret", "http_writev_ret", "http_sendmsg_ret")
# Programs other programs tail-call (bpf_tail_call through a prog array): (array, index, function,
# the probes whose programs call it). The loader loads each and puts it in its slot before it
# attaches those probes; one that fails to load leaves them missing with its reason.
TAILS: tuple[tuple[str, int, str, tuple[str, ...]], ...] = (
    ("http_tail", 0, "http_rx_step", _HTTP_RX),  # enum mcp_http_tail
    ("http_tail", 1, "http_rx_post", _HTTP_RX),
    ("http_tail", 2, "http_tx_step", _HTTP_TX),
    ("http_tail", 3, "http_tx_post", _HTTP_TX),
)


def probe_names() -> list[str]:
    return [p.name for p in PROBES]


@dataclass
class ProbeStatus:
    spec: ProbeSpec
    state: str
    reason: str = ""
    hint: str = ""


@dataclass
class ProbePlan:
    """Which probes to compile, and the statuses of those already decided (disabled, absent)."""

    statuses: dict[str, ProbeStatus] = field(default_factory=dict)

    def enabled(self, program: str | None = None) -> list[ProbeSpec]:
        """Those compiled (before the load: to be compiled): neither missing nor disabled."""
        return [s.spec for s in self.statuses.values()
                if s.state not in (MISSING, DISABLED) and (program is None or s.spec.program == program)]

    def mark(self, name: str, state: str, reason: str = "", hint: str = "") -> None:
        st = self.statuses[name]
        st.state, st.reason, st.hint = state, reason, hint or st.hint

    def missing(self) -> list[ProbeStatus]:
        return [s for s in self.statuses.values() if s.state == MISSING]

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys((ATTACHED, MISSING, DISABLED, *UPROBE_STATES), 0)
        for s in self.statuses.values():
            out[s.state] = out.get(s.state, 0) + 1
        return out

    def live(self) -> int:
        """Probes whose programs are attached now: attached tracepoints, armed (or duty-cycled) uprobes."""
        return sum(1 for s in self.statuses.values() if s.state in LIVE)

    def summary(self) -> str:
        """`run`'s start-up line: "N attached, N missing, N disabled" and the uprobe families' states."""
        c = self.counts()
        up = [f"{c[k]} {k}" for k in UPROBE_STATES if c[k]]
        return (f"{c[ATTACHED]} attached, {c[MISSING]} missing, {c[DISABLED]} disabled"
                + (f"; libcuda uprobes {', '.join(up)}" if up else ""))


HTTP_PROBES = tuple(p.name for p in PROBES if p.program == "http.bpf.c")


def switched_off(cfg) -> dict[str, str]:
    """Probes a setting other than probes.disable turns off -> the reason shown."""
    off = {} if cfg.requests_http else dict.fromkeys(HTTP_PROBES, "disabled by requests.http = false")
    return off


def plan(disabled: list[str] | tuple[str, ...] = (), exists=tracepoint_exists, off: dict[str, str] | None = None) -> ProbePlan:
    """Decide before compiling. State ATTACHED here means 'to be attached'; the loader corrects it.
    off: probes turned off by other settings (switched_off), with their reasons."""
    p = ProbePlan()
    off = off or {}
    for spec in PROBES:
        if spec.name in disabled or spec.name in off:
            p.statuses[spec.name] = ProbeStatus(spec, DISABLED, off.get(spec.name, "disabled by probes.disable"))
        elif spec.kind in TRACEPOINT_KINDS and not exists(*spec.tracepoint.split(":")):
            why = MISSING_WHY.get(spec.tracepoint.replace(":", "/"))
            p.statuses[spec.name] = ProbeStatus(
                spec, MISSING, why or f"tracepoint {spec.tracepoint} not in this kernel's tracefs", spec.hint)
        else:
            p.statuses[spec.name] = ProbeStatus(spec, ATTACHED)
    return p


def render_table(p: ProbePlan) -> str:
    rows = [("PROBE", "HOOK", "STATE", "DETAIL")]
    for s in p.statuses.values():
        detail = s.reason or s.spec.provides
        if s.state == MISSING and s.hint:
            detail += f" (HINT: {s.hint})"
        rows.append((s.spec.name, s.spec.tracepoint, s.state, detail))
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]}" for r in rows)
