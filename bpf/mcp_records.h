/* Records shared by the BPF programs and user space: the one place their layout is defined.
 *
 * agent/core/records.py mirrors every struct here with ctypes; tests/core/test_layout.py compiles this header
 * with the host C compiler and checks sizes and offsets against the mirror, so the two cannot drift.
 * Only fixed-width __u* types and explicit padding: the same bytes on both sides of the ring buffer.
 */
#ifndef MCP_RECORDS_H
#define MCP_RECORDS_H

#include <linux/types.h>

/* ---- the request marker: the wire format a serving process uses (docs/MARKER.md) ----
 * ioctl(-1, MCP_MARK_CMD, &struct mcp_mark): the kernel fails it with EBADF before any driver sees
 * it, and syscalls:sys_enter_ioctl has already run, so the BPF side reads the struct from the caller's
 * memory. The kernel supplies the thread id: a process can only mark its own threads. */
#define MCP_MARK_MAGIC 0x4150434dU /* "MCPA" little-endian */
#define MCP_MARK_VERSION 1
#define MCP_MARK_CMD 0x4048eb01U   /* _IOW(0xeb, 0x01, struct mcp_mark): type 0xeb is unassigned in ioctl-number.rst */
#define MCP_OP_BEGIN 1
#define MCP_OP_END 2
#define MCP_TRACEPARENT_LEN 56     /* W3C traceparent, 55 chars + NUL */

struct mcp_mark {
	__u32 magic;
	__u16 version;
	__u16 op;
	__u64 request_id;
	char traceparent[MCP_TRACEPARENT_LEN];
};

/* ---- counters accumulated in the kernel, per request and per process ----
 * One struct for every probe family, so a request's END record and a process's counters carry all
 * of them; agent/core/decode.py derives its Counters record from this layout. Append only. */
struct mcp_counters {
	/* requests.bpf.c */
	__u64 faults;            /* exceptions:page_fault_user */
	__u64 vcsw;              /* sched:sched_switch, task blocked (prev_state not running, not preempted) */
	__u64 ivcsw;             /* sched:sched_switch, task preempted or yielded while runnable */
	__u64 offcpu_ns;         /* switched out -> switched back in */
	/* reclaim.bpf.c */
	__u64 direct_reclaims;   /* vmscan:mm_vmscan_direct_reclaim_begin/end pairs */
	__u64 direct_reclaim_ns;
	__u64 memcg_reclaims;    /* vmscan:mm_vmscan_memcg_reclaim_begin/end pairs */
	__u64 memcg_reclaim_ns;
	__u64 reclaimed_pages;   /* nr_reclaimed of both kinds */
	__u64 kswapd_wakeups;    /* vmscan:mm_vmscan_wakeup_kswapd caused by this task */
	/* cuda.bpf.c (uprobes in libcuda.so) and NVIDIA ioctls */
	__u64 cu_launch;         /* cuLaunchKernel */
	__u64 cu_launch_ptsz;    /* cuLaunchKernel_ptsz */
	__u64 cu_launch_ex;      /* cuLaunchKernelEx */
	__u64 cu_launch_ex_ptsz; /* cuLaunchKernelEx_ptsz */
	__u64 cu_graph_launch;   /* cuGraphLaunch(_ptsz) */
	__u64 cu_ctx_ops;        /* cuCtxPushCurrent(_v2), cuCtxPopCurrent(_v2), cuCtxSetCurrent */
	__u64 cu_ctx_ns;
	__u64 cu_syncs;          /* cuStreamSynchronize(_ptsz), cuCtxSynchronize, cuEventSynchronize */
	__u64 cu_sync_ns;
	__u64 cu_allocs;         /* cuMemAlloc_v2, cuMemAllocAsync(_ptsz) */
	__u64 cu_alloc_ns;
	__u64 cu_frees;          /* cuMemFree_v2 */
	__u64 cu_free_ns;
	__u64 nv_ioctls;         /* ioctls on /dev/nvidia* */
	__u64 nv_ioctl_ns;
	__u64 sampled;           /* non-zero: some high-rate CUDA counts were duty-cycled (scaled) */
	/* requests.bpf.c, appended */
	__u64 offcpu_runnable_ns; /* the part of offcpu_ns switched out while runnable (preempted or
	                           * yielded: prev_state 0 or TASK_REPORT_MAX) -> back in: run-queue wait */
	__u64 wakeup_wait_ns;    /* sched:sched_wakeup(_new) -> switched in, after a sleep: run-queue wait
	                          * at wake-up; with offcpu_runnable_ns, all of it (schedstat's run delay) */
	__u64 wakeups;           /* wake-ups measured in wakeup_wait_ns */
	__u64 cu_alloc_oom;      /* cuMemAlloc_v2/cuMemAllocAsync(_ptsz) returning CUDA_ERROR_OUT_OF_MEMORY */
	/* requests.bpf.c, appended: NUMA locality of the time on a CPU (switched in -> out) */
	__u64 oncpu_ns;
	__u64 oncpu_homed_ns;    /* the part while the process had a home node (map numa_home: its GPUs' node) */
	__u64 oncpu_remote_ns;   /* the part of that on a CPU of another node (bpf_get_numa_node_id()) */
	/* requests.bpf.c, appended */
	__u64 pagecache_added_bytes; /* filemap:mm_filemap_add_to_page_cache in the thread's context */
};

/* per-thread state of an open request (map req_by_tid) */
struct mcp_req_state {
	__u64 request_id;
	__u64 begin_ns;
	__u32 tgid;
	__u32 flags;
	struct mcp_counters c;
};

/* per-process state for bounding markers (map tgid_state); created by the process's first begin */
struct mcp_tgid_state {
	__u32 open;            /* threads of this process with an open request */
	__u32 window_begins;   /* begins seen in the current one-second window */
	__u64 window_start_ns;
	__u32 uid;             /* owner budgets charged for it (map budgets): the marking thread's uid */
	__u32 exempt;          /* 1: an allowed marker (requests.mark_users/mark_cgroups), no owner budgets */
	__u64 cgroup_id;       /* and its cgroup v2 id */
};

/* Owner budgets (map budgets, and the allow list mark_allow): a uid or a cgroup v2 id. Per-process
 * bounds alone let one user with many processes or threads fill the shared maps and ring buffer. */
enum mcp_owner_kind {
	MCP_OWNER_UID = 1,
	MCP_OWNER_CGROUP = 2,
};

struct mcp_owner_key {
	__u32 kind;            /* enum mcp_owner_kind */
	__u32 pad;
	__u64 id;              /* uid, or cgroup v2 id (the cgroup directory's inode) */
};

/* array req_flow: records reserved in req_events (the kernel), records the agent has read (the agent,
 * after each poll). Their difference is the reader's lag, which a bcc 0.26 program cannot ask the
 * ring for (no bpf_ringbuf_query() map reference). */
enum mcp_req_flow {
	MCP_FLOW_PRODUCED = 0,
	MCP_FLOW_CONSUMED = 1,
	MCP_FLOW_MAX = 2,
};

struct mcp_budget {
	__u64 window_start_ns;
	__u32 window_begins;   /* begins in the current one-second window */
	__u32 open;            /* open requests of this owner's threads */
	__u32 procs;           /* processes of this owner with a tgid_state entry */
	__u32 prev_begins;     /* begins in the window before (0 when that was over a second earlier) */
};

/* off-CPU interval start of a traced thread (map offcpu_start) */
struct mcp_offcpu {
	__u64 ts_ns;
	__u32 tgid;
	__u32 runnable;        /* switched out while runnable: the interval is waiting for a CPU */
	__u64 group;           /* its cgroup's id when that is a serving group (map group_stats), else 0 */
	__u32 thread;          /* 1: the thread's own counters (map thread_stats) get the interval */
	__u32 pad;
	__u64 woken_ns;        /* sched_wakeup of the sleeping thread, 0 before it */
};

/* Per CPU: the thread running there since ts_ns (sched_switch; a request's edge restarts it) */
struct mcp_cpu_run {
	__u64 ts_ns;
	__u32 tid;
	__u32 pad;
	__u64 unseen_from;  /* tid's switch-in was not seen: its off-CPU interval ended by then (0: none) */
};

/* ---- ring buffer records: every record starts with the common header ---- */
enum mcp_event_type {
	MCP_EV_REQ_BEGIN = 1,
	MCP_EV_REQ_END = 2,
	MCP_EV_PROC_EXIT = 3,
	MCP_EV_RECLAIM_STALL = 4, /* one direct or memcg reclaim stall over the threshold */
	MCP_EV_KSWAPD = 5,        /* kswapd woke or went to sleep on a node */
	MCP_EV_TP_RAW = 6,        /* health.bpf.c: the first bytes of a GPU/PCIe health tracepoint record */
};

enum mcp_reclaim_kind {
	MCP_RECLAIM_DIRECT = 0,
	MCP_RECLAIM_MEMCG = 1,
};

enum mcp_end_reason {
	MCP_END_MARKED = 0,     /* the thread marked the end */
	MCP_END_SUPERSEDED = 1, /* a new begin on the same thread before an end */
	MCP_END_THREAD_EXIT = 2,/* the thread exited inside the request */
	MCP_END_ID_MISMATCH = 3,/* end carried another request id than the open one */
};

struct mcp_hdr {
	__u16 type;      /* enum mcp_event_type */
	__u16 size;      /* sizeof the whole record */
	__u32 tgid;
	__u32 tid;
	__u32 cpu;
	__u64 ts_ns;     /* bpf_ktime_get_ns(): CLOCK_MONOTONIC */
	__u64 cgroup_id; /* bpf_get_current_cgroup_id(): inode of the task's cgroup v2 directory */
	char comm[16];
};

struct mcp_ev_req_begin {
	struct mcp_hdr h;
	__u64 request_id;
	char traceparent[MCP_TRACEPARENT_LEN];
};

struct mcp_ev_req_end {
	struct mcp_hdr h;
	__u64 request_id;
	__u64 begin_ns;
	__u32 reason;    /* enum mcp_end_reason */
	__u32 pad;
	struct mcp_counters c;
};

struct mcp_ev_proc_exit {
	struct mcp_hdr h;
	struct mcp_counters c; /* the process's final per-process counters */
};

struct mcp_ev_reclaim_stall {
	struct mcp_hdr h;      /* the stalled thread; ts_ns = end of the stall */
	__u64 begin_ns;
	__u64 nr_reclaimed;
	__u64 gfp_flags;
	__u32 kind;            /* enum mcp_reclaim_kind */
	__s32 order;
	__u64 request_id;      /* the thread's open request, 0 if none */
};

struct mcp_ev_kswapd {
	struct mcp_hdr h;      /* kswapd itself */
	__u32 nid;
	__u32 awake;           /* 1: kswapd_wake, 0: kswapd_sleep */
	__s32 order;           /* at wake */
	__u32 pad;
};

/* host-wide reclaim totals (per-CPU array reclaim_totals), by who reclaimed. Scanned/reclaimed
 * come from vmscan:mm_vmscan_lru_shrink_inactive, the same values shrink_inactive_list() adds to
 * /proc/vmstat pgscan_* / pgsteal_* (global reclaim only: memcg reclaim is not in vmstat). */
enum mcp_reclaim_total {
	MCP_RT_DIRECT_NS = 0,
	MCP_RT_DIRECTS,
	MCP_RT_MEMCG_NS,
	MCP_RT_MEMCGS,
	MCP_RT_KSWAPD_WAKEUPS,   /* mm_vmscan_wakeup_kswapd */
	MCP_RT_SCAN_KSWAPD,
	MCP_RT_STEAL_KSWAPD,
	MCP_RT_SCAN_DIRECT,
	MCP_RT_STEAL_DIRECT,
	MCP_RT_SCAN_MEMCG,
	MCP_RT_STEAL_MEMCG,
	MCP_RT_MAX,
};

/* per-thread reclaim begin (map reclaim_start) */
struct mcp_reclaim_start {
	__u64 ts_ns;
	__u64 gfp_flags;
	__s32 order;
	__u32 kind;
};

/* ---- per-CPU health counters (map stats), exported as agent metrics ---- */
enum mcp_stat {
	MCP_STAT_RB_LOST = 0,      /* ring buffer full: record not sent */
	MCP_STAT_MARK_FAULT,       /* marker argument unreadable */
	MCP_STAT_MARK_BAD,         /* bad magic, version or op */
	MCP_STAT_BEGIN_CAP,        /* begin refused: process at its open-request cap */
	MCP_STAT_BEGIN_RATE,       /* begin refused: process over its begin rate */
	MCP_STAT_BEGIN_MAP_FULL,   /* begin refused: request map full */
	MCP_STAT_BEGIN_SUPERSEDED, /* begin on a thread with an open request */
	MCP_STAT_END_NO_BEGIN,     /* end on a thread with no open request */
	MCP_STAT_END_MISMATCH,     /* end with another request id */
	MCP_STAT_PROC_MAP_FULL,    /* per-process counters map full */
	MCP_STAT_RECLAIM_NO_BEGIN, /* reclaim end on a thread with no recorded begin */
	MCP_STAT_CU_LAUNCH_HITS,   /* cuLaunchKernel* uprobe hits x their weight, every process (the governor's host-wide rate) */
	MCP_STAT_CU_AUTO_WATCH,    /* processes put in the watch set by their first CUDA call (process.watch = gpu) */
	MCP_STAT_CU_PAIR_MISS,     /* CUDA call return with no recorded entry (attached mid-call, nested call) */
	MCP_STAT_CU_PAIR_STALE,    /* CUDA call entry older than the sanity bound: dropped, not measured */
	MCP_STAT_CU_MAP_FULL,      /* CUDA per-thread state not stored */
	MCP_STAT_TP_READ_SHORT,    /* health tracepoint: the MCP_TP_RAW_LEN read failed, MCP_TP_RAW_MIN kept */
	MCP_STAT_TP_READ_FAIL,     /* health tracepoint: no byte of the record readable, nothing sent */
	MCP_STAT_MARK_DENIED,      /* marker from a uid/cgroup not in requests.mark_users/mark_cgroups */
	MCP_STAT_BEGIN_UID_RATE,   /* begin refused: its uid over requests.max_begins_per_s_per_uid */
	MCP_STAT_BEGIN_CGROUP_RATE,/* begin refused: its cgroup over requests.max_begins_per_s_per_cgroup */
	MCP_STAT_BEGIN_UID_OPEN,   /* begin refused: its uid at requests.max_open_per_uid */
	MCP_STAT_BEGIN_CGROUP_OPEN,/* begin refused: its cgroup at requests.max_open_per_cgroup */
	MCP_STAT_BEGIN_UID_PROCS,  /* begin refused: its uid at requests.max_procs_per_uid marking processes */
	MCP_STAT_BEGIN_CGROUP_PROCS,/* begin refused: its cgroup at requests.max_procs_per_cgroup */
	MCP_STAT_BUDGET_MAP_FULL,  /* begin refused: no budget entry could be made */
	MCP_STAT_RB_REQ_LOST,      /* request ring buffer full: BEGIN/END/stall record not sent */
	MCP_STAT_BEGIN_PRESSURE,   /* begin refused: the reader is behind and its owner is past its share */
	MCP_STAT_RB_HTTP_LOST,     /* HTTP ring buffer full: an HTTP BEGIN/END record not sent */
	MCP_STAT_HTTP_CONN_FULL,   /* HTTP connection not followed: map http_conn full */
	MCP_STAT_HTTP_RATE,        /* HTTP request not followed: its process over its begins per second */
	MCP_STAT_HTTP_ARGS_FULL,   /* socket syscall not followed: map http_args full */
	MCP_STAT_SWITCH_IN_UNSEEN, /* a traced thread's slice whose switch-in sched_switch did not see: counted from the CPU's last switch */
	MCP_STAT_HTTP_DENIED,      /* HTTP request not followed: its process's owner not in requests.mark_users/mark_cgroups */
	MCP_STAT_HTTP_PROC_FULL,   /* HTTP request not followed: map http_proc full */
	MCP_STAT_HTTP_UID_RATE,    /* HTTP request not followed: its uid over requests.max_begins_per_s_per_uid */
	MCP_STAT_HTTP_CGROUP_RATE, /* HTTP request not followed: its cgroup over requests.max_begins_per_s_per_cgroup */
	MCP_STAT_HTTP_PRESSURE,    /* HTTP request not followed: the reader is behind and its owner is past its share */
	MCP_STAT_HTTP_UID_CONNS,   /* HTTP connection not followed: its uid holds requests.http_conns_per_owner */
	MCP_STAT_HTTP_CGROUP_CONNS,/* HTTP connection not followed: its cgroup holds requests.http_conns_per_owner */
	MCP_STAT_HTTP_PIPELINE_FULL,/* HTTP connection not followed further: over MCP_HTTP_PIPELINE requests in flight */
	MCP_STAT_HTTP_FRAMING_LOST,/* HTTP connection not followed further: a call held more than the framing steps follow */
	MCP_STAT_HTTP_FD_REUSED,   /* HTTP requests ended: their fd names another socket (closed unseen) */
	MCP_STAT_HTTP_TAIL_FAIL,   /* HTTP call not followed: a framing program's tail call failed */
	MCP_STAT_WATCH_UID_FULL,   /* process not watched by the kernel (a watched one's child, an exec'd process.comms name): its uid holds MCP_WATCH_KERNEL_PER_UID */
	MCP_STAT_WATCH_MAP_FULL,   /* process not watched by the kernel: watch_tgid or watch_heirs full */
	MCP_STAT_MAX,
};

/* ---- CUDA driver calls and NVIDIA ioctls (cuda.bpf.c, agent/cuda/capability.py) ---- */
enum mcp_cuda_event_type {
	MCP_EV_GPU_STEP = 10,     /* zero-touch: a sync call returned on a thread outside any request */
};

enum mcp_cu_family {          /* entry/return pairs, one pending slot per family per thread */
	MCP_CU_CTX = 0,           /* cuCtxPushCurrent(_v2), cuCtxPopCurrent(_v2), cuCtxSetCurrent */
	MCP_CU_SYNC = 1,          /* cuStreamSynchronize(_ptsz), cuCtxSynchronize(_v2), cuEventSynchronize */
	MCP_CU_ALLOC = 2,         /* cuMemAlloc_v2, cuMemAllocAsync(_ptsz) */
	MCP_CU_FREE = 3,          /* cuMemFree_v2, cuMemFreeAsync(_ptsz) */
	MCP_CU_FAMILIES = 4,
};

enum mcp_cu_sync_kind {
	MCP_CU_SYNC_STREAM = 0,
	MCP_CU_SYNC_CTX = 1,
	MCP_CU_SYNC_EVENT = 2,
};

enum mcp_hist_kind {          /* per-process log2 latency histograms (map cu_hist) */
	MCP_HIST_CTX = 0,
	MCP_HIST_SYNC = 1,
	MCP_HIST_IOCTL = 2,
	MCP_HIST_ALLOC = 3,
	MCP_HIST_FREE = 4,
};

enum mcp_cu_config {          /* array cu_config, written by agent/cuda/capability.py at run time */
	MCP_CFG_WEIGHT_LAUNCH = 0,         /* a cuLaunchKernel hit counts this much (probe on 1/weight */
	MCP_CFG_WEIGHT_LAUNCH_PTSZ = 1,    /* of the time: the duty cycle); 0 or 1: exact. One per */
	MCP_CFG_WEIGHT_LAUNCH_EX = 2,      /* launch symbol: one not called stays attached and exact */
	MCP_CFG_WEIGHT_LAUNCH_EX_PTSZ = 3,
	MCP_CFG_AUTO_WATCH = 4,   /* 1: a process's first CUDA call puts it in watch_tgid */
	MCP_CFG_MAX_CALL_NS = 5,  /* entry older than this at return: stale, dropped */
	MCP_CFG_MAX = 8,
};

struct mcp_cu_pend_key {
	__u32 tid;
	__u32 family;             /* enum mcp_cu_family */
};

struct mcp_cu_pend {
	__u64 ts_ns;
	__u32 kind;               /* enum mcp_cu_sync_kind for MCP_CU_SYNC */
	__u32 pad;
};

/* zero-touch state of a thread outside requests (map cu_thread): its counters since its last sync */
struct mcp_cu_thread {
	__u64 step_begin_ns;
	__u32 tgid;
	__u32 pad;
	struct mcp_counters c;
};

struct mcp_hist_key {
	__u32 tgid;
	__u16 kind;               /* enum mcp_hist_kind */
	__u16 slot;               /* log2(ns) */
};

/* an NVIDIA device fd of a watched process (map nv_fds, kept by agent/cuda/ioctl.py from /proc/PID/fd) */
struct mcp_nv_fd_key {
	__u32 tgid;
	__u32 fd;
};

struct mcp_nv_ioctl_start {
	__u64 ts_ns;
	__u32 cmd;
	__u32 dev;                /* device id given by agent/cuda/capability.py (one per device path) */
};

struct mcp_nv_cmd_key {
	__u32 tgid;
	__u32 cmd;
	__u32 dev;
	__u32 pad;
};

struct mcp_nv_cmd_val {
	__u64 count;
	__u64 ns;
};

struct mcp_ev_gpu_step {
	struct mcp_hdr h;         /* the thread; ts_ns = the closing sync's return */
	__u64 begin_ns;           /* the previous sync return on this thread, or its first counted CUDA call */
	__u64 sync_ns;            /* the closing sync's wait */
	__u32 sync_kind;          /* enum mcp_cu_sync_kind */
	__u32 pad;
	struct mcp_counters c;    /* the thread's CUDA counters over the step, closing sync included */
};

/* ---- GPU and PCIe health tracepoints (health.bpf.c, agent/gpuhealth/health_records.py) ----
 * bcc's TRACEPOINT_PROBE needs a tracepoint's format at compile time, and nvidia:nvidia_dev_xid
 * exists only while the driver is loaded (ras:aer_event, pci:pcie_link_event only on some kernels),
 * so the BPF side copies the record's first bytes and user space decodes them with the format it
 * reads from tracefs at run time. A BPF_PROG_TYPE_TRACEPOINT program's ctx is the record in the
 * per-CPU perf trace buffer (PERF_MAX_TRACE_SIZE, 8192 bytes; kernel/trace/trace_event_perf.c), so a
 * fixed-size read past a shorter record stays inside that buffer; bytes past the record are stale. */
#define MCP_TP_RAW_LEN 512
#define MCP_TP_RAW_MIN 64         /* the fallback read when MCP_TP_RAW_LEN bytes cannot be read */

enum mcp_tp_kind {
	MCP_TP_NVIDIA_DEV_XID = 1,    /* nvidia:nvidia_dev_xid */
	MCP_TP_AER_EVENT = 2,         /* ras:aer_event */
	MCP_TP_PCIE_LINK_EVENT = 3,   /* pci:pcie_link_event */
	MCP_TP_OOM_MARK_VICTIM = 4,   /* oom:mark_victim (reclaim: OOM kills) */
	MCP_TP_TEST_EXEC = 15,        /* sched:sched_process_exec, compiled only for tests (MCP_TEST_TP_RAW_EXEC) */
};

struct mcp_ev_tp_raw {
	struct mcp_hdr h;         /* the task that ran the tracepoint (for an Xid, often the driver's irq thread) */
	__u32 kind;               /* enum mcp_tp_kind */
	__u32 len;                /* bytes of data read: MCP_TP_RAW_LEN, or MCP_TP_RAW_MIN after a failed read */
	__u8 data[MCP_TP_RAW_LEN];/* the tracepoint record, its 8-byte common header zeroed (the kernel
	                           * keeps a pt_regs pointer there for BPF); stale bytes past its end */
};

/* ---- zero-code HTTP/1.1 requests (http.bpf.c, agent/http) ----
 * Socket syscalls of watched processes: every byte a server reads or writes on a followed connection
 * goes through one framing state per direction (struct mcp_http_dir): request heads scanned across
 * reads, bodies skipped by Content-Length or chunk by chunk, responses likewise. A request begins
 * when its head is whole and ends when its response is (or the connection closes). BEGIN and END
 * carry the counters of the request's thread, its process and its serving group at that moment:
 * user space takes the differences. */
#define MCP_HTTP_HEAD_LEN 1024      /* bytes of a request head sent to user space (method, target, traceparent) */
#define MCP_HTTP_WIN 512            /* bytes of a call scanned per step (one window) */
#define MCP_HTTP_CARRY 32           /* a line's first bytes kept over a call boundary */
#define MCP_HTTP_STEPS 12           /* framing steps per call (a window of a head, a body, a chunk line...) */
#define MCP_HTTP_PIPELINE 4         /* requests in flight at once on one connection (pipelined) */

enum mcp_http_tail {                /* prog array http_tail: the framing's programs, tail-called */
	MCP_HTTP_TAIL_RX_STEP = 0,
	MCP_HTTP_TAIL_RX_POST = 1,
	MCP_HTTP_TAIL_TX_STEP = 2,
	MCP_HTTP_TAIL_TX_POST = 3,
};

enum mcp_http_event_type {
	MCP_EV_HTTP_BEGIN = 20,
	MCP_EV_HTTP_END = 21,
};

enum mcp_http_state {               /* one direction's framing */
	MCP_HTTP_ST_BOUNDARY = 0,   /* between messages: the next byte begins a head (CR/LF skipped) */
	MCP_HTTP_ST_HEAD = 1,       /* a head's lines, to the empty line */
	MCP_HTTP_ST_BODY = 2,       /* left bytes of a Content-Length body */
	MCP_HTTP_ST_CHUNK_SIZE = 3, /* a chunk-size line: hex digits (left), extensions, LF */
	MCP_HTTP_ST_CHUNK_DATA = 4, /* left bytes of a chunk's data */
	MCP_HTTP_ST_CHUNK_END = 5,  /* the CRLF after a chunk's data */
	MCP_HTTP_ST_TRAILER = 6,    /* trailer fields after the last chunk, to the empty line */
	MCP_HTTP_ST_UNTIL_CLOSE = 7,/* a response without framing: its body lasts until the close */
	MCP_HTTP_ST_LOST = 8,       /* framing lost (counted): nothing followed until the entry goes */
	MCP_HTTP_ST_UPGRADED = 9,   /* 101 Switching Protocols, a CONNECT tunnel: no longer HTTP/1.1 */
};

/* struct mcp_http_dir.flags: what the head said */
#define MCP_HTTP_F_LENGTH 1         /* Content-Length (its bytes in clv) */
#define MCP_HTTP_F_CHUNKED 2        /* Transfer-Encoding */
#define MCP_HTTP_F_HEAD_METHOD 4    /* a HEAD request: its response has no body */
#define MCP_HTTP_F_TUNNEL 8         /* a CONNECT request */
#define MCP_HTTP_F_DIGITS 16        /* a chunk-size line's digits began */
#define MCP_HTTP_F_EXT 32           /* a chunk-size line's digits ended */

/* struct mcp_ev_http_begin.flags */
#define MCP_HTTP_BEGIN_TRUNCATED 1  /* the head was longer than MCP_HTTP_HEAD_LEN - 1: cut */
#define MCP_HTTP_BEGIN_PARTIAL 2    /* the head's first bytes were not kept (its pend entry lost) */

enum mcp_http_mode {                /* how the response's end was found */
	MCP_HTTP_MODE_UNKNOWN = 0,  /* no framing: ends at the close */
	MCP_HTTP_MODE_LENGTH = 1,   /* head + Content-Length bytes (no body: HEAD, 204, 304) */
	MCP_HTTP_MODE_CHUNKED = 2,  /* the last chunk and the trailer */
};

enum mcp_http_end_reason {
	MCP_HTTP_END_COMPLETE = 0,  /* the response's framing says it is whole */
	MCP_HTTP_END_CLOSE = 1,     /* the connection closed first (or its fd now names another socket) */
	MCP_HTTP_END_MARKED = 2,    /* the process marks its requests: this zero-code one is dropped */
};

enum mcp_http_syscall {         /* which syscall's arguments map http_args holds */
	MCP_HTTP_SYS_READ = 0,      /* read, recvfrom: (fd, buf) */
	MCP_HTTP_SYS_WRITE = 1,     /* write, sendto: (fd, buf) */
	MCP_HTTP_SYS_WRITEV = 2,    /* writev: (fd, iov, iovcnt) */
	MCP_HTTP_SYS_SENDMSG = 3,   /* sendmsg: (fd, msghdr) */
};

struct mcp_http_args {          /* a socket syscall of a watched thread between its entry and exit */
	__u64 buf;                  /* buffer, iovec array or msghdr */
	__u64 count;                /* bytes asked for, or iovcnt */
	__u32 fd;
	__u32 sys;                  /* enum mcp_http_syscall */
	__u64 sk;                   /* the struct sock (sock:sock_*_length): never leaves the kernel */
	__u32 sock;                 /* 1: the socket layer ran for this call */
	__u32 pad;
};

struct mcp_http_conn_key {
	__u32 tgid;
	__u32 fd;
};

struct mcp_http_dir {           /* one direction's framing: request bytes read, response bytes written */
	__u64 left;                 /* BODY, CHUNK_DATA: bytes left; CHUNK_SIZE: the size so far */
	__u8 state;                 /* enum mcp_http_state */
	__u8 midline;               /* the current line's start was looked at, its LF not yet seen */
	__u8 carry_len;             /* bytes in carry: a line's start too short to tell, from the last call */
	__u8 flags;                 /* MCP_HTTP_F_* */
	__u16 lines;                /* lines of the head so far */
	__u16 status;               /* a response's status code */
	__u8 clv[24];               /* the bytes after "Content-Length:", read once the head is whole */
	__u8 carry[MCP_HTTP_CARRY];
};

struct mcp_http_req {           /* a request in flight on a connection */
	__u64 begin_ns;
	__u64 seq;
	__u64 group;                /* the serving group its BEGIN's snapshot was taken of */
	__u32 tid;                  /* the thread that read the head's last bytes: the request's thread */
	__u8 head_only;             /* HEAD: its response has no body */
	__u8 tunnel;                /* CONNECT: a 2xx answer makes the connection a tunnel */
	__u8 ghost;                 /* its BEGIN was refused or lost: it holds its place, sends no END */
	__u8 pad;
};

struct mcp_http_conn {          /* map http_conn: a connection with a request in flight */
	__u64 sk;                   /* its socket: an fd reused for another one is told apart */
	__u64 conn_id;              /* when this entry was made (ns) */
	__u64 gen;                  /* struct mcp_http_proc.gen of its process: its share was charged there */
	__u64 seq;                  /* requests begun in this entry */
	__u64 written;              /* bytes of the response being written (interim ones included) */
	__u64 interim;              /* of which 1xx responses (100 Continue) */
	__u32 rx_seq;               /* requests begun ... */
	__u32 tx_seq;               /* ... and answered: q[tx_seq % PIPELINE] is the one answered next */
	__u8 tx_mode;               /* enum mcp_http_mode of the response being written */
	__u8 pad[7];
	struct mcp_http_dir rx, tx;
	struct mcp_http_req q[MCP_HTTP_PIPELINE];
};

struct mcp_http_pend {          /* map http_pend (LRU): a head arriving over several reads */
	__u64 sk;
	__u64 first_ns;             /* its first byte's read */
	__u32 len;                  /* bytes of it in head */
	__u32 reads;
	__u32 flags;                /* MCP_HTTP_BEGIN_* */
	__u32 pad;
	struct mcp_http_dir rx;     /* the framing, for a connection not in http_conn */
	__u8 head[2 * MCP_HTTP_HEAD_LEN]; /* MCP_HTTP_HEAD_LEN - 1 used: the rest lets the verifier bound a copy */
};

struct mcp_http_proc {          /* map http_proc: a process with zero-code requests */
	__u64 gen;                  /* when this entry was made: its connections' shares belong to it */
	__u64 window_start_ns;
	__u64 cgroup_id;            /* its owners (as a marking process's, struct mcp_tgid_state) */
	__u32 uid;
	__u32 exempt;               /* allowed by requests.mark_users / mark_cgroups: no owner shares */
	__u32 begins;               /* in the current one-second window */
	__u32 conns;                /* its entries in http_conn */
};

struct mcp_http_budget {        /* map http_owners: an owner's (enum mcp_owner_kind) zero-code share */
	__u64 window_start_ns;
	__u32 begins;
	__u32 prev_begins;
	__u32 conns;
	__u32 pad;
	__u64 begun;                /* BEGINs sent: minus http_owner_read's, those the agent has not read */
};

struct mcp_ev_http_begin {
	struct mcp_hdr h;           /* the thread that read the head's end; ts_ns = then */
	__u64 conn_id;
	__u64 seq;
	__u64 group;                /* the serving group: the thread's cgroup id, or a tree's key */
	__u64 first_ns;             /* the head's first byte's read */
	__u32 fd;
	__u32 head_len;             /* bytes of head[] read from the data (< MCP_HTTP_HEAD_LEN) */
	__u32 reads;                /* reads the head came in */
	__u32 flags;                /* MCP_HTTP_BEGIN_* */
	__u32 owner_uid;            /* the owners it is counted to (struct mcp_http_proc) */
	__u32 exempt;
	__u64 owner_cgroup;
	struct mcp_counters thread, proc, grp; /* at the begin */
	__u8 head[MCP_HTTP_HEAD_LEN];
};

struct mcp_ev_http_end {
	struct mcp_hdr h;           /* the thread that ended it; ts_ns = the end */
	__u64 conn_id;
	__u64 seq;
	__u64 begin_ns;
	__u64 written;              /* response bytes written, 1xx responses included */
	__u64 interim;              /* of which 1xx responses */
	__u64 group;
	__u32 fd;
	__u32 begin_tid;
	__u16 status;
	__u8 reason;                /* enum mcp_http_end_reason */
	__u8 mode;                  /* enum mcp_http_mode */
	__u32 pad;
	struct mcp_counters thread, proc, grp; /* at the end: of begin_tid, the process, the group */
};

#endif
