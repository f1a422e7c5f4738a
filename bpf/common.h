/* Records every BPF family shares with user space: the counters kept per request, thread, process
 * and group, the header every ring-buffer record starts with, owners, the stats ranges. Each family's
 * own records are in its header (requests.h, reclaim.h, cuda.h, gpuhealth.h, http.h): the one place
 * their layout is defined. Each capability's records.py mirrors its structs with ctypes and
 * tests/core/test_layout.py checks them against the host C compiler. Only fixed-width __u* types and
 * explicit padding: the same bytes on both sides of the ring buffer.
 */
#ifndef MCP_COMMON_H
#define MCP_COMMON_H

#include <linux/types.h>

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

/* ---- ring buffer records: every record starts with the common header; each family numbers its
 * own record types (requests 1-3, reclaim 4-5, raw tracepoint copies 6, cuda 10, http 20-21) ---- */
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

/* Owners (uid or cgroup v2 id) of what a local user's processes put in the shared maps: the
 * marker's budgets and allow list (requests.bpf.c), HTTP's shares (http.bpf.c). */
enum mcp_owner_kind {
	MCP_OWNER_UID = 1,
	MCP_OWNER_CGROUP = 2,
};

struct mcp_owner_key {
	__u32 kind;            /* enum mcp_owner_kind */
	__u32 pad;
	__u64 id;              /* uid, or cgroup v2 id (the cgroup directory's inode) */
};

/* ---- a tracepoint's record, copied raw (common.bpf.c tp_raw_capture): each capability that has
 * such probes numbers its kinds in its header (gpuhealth 1, pcie 2-3, reclaim 4) ---- */
enum mcp_raw_event_type {
	MCP_EV_TP_RAW = 6,
};
#define MCP_TP_RAW_LEN 512
#define MCP_TP_RAW_MIN 64         /* the fallback read when MCP_TP_RAW_LEN bytes cannot be read */
enum mcp_tp_kind_common {
	MCP_TP_TEST_EXEC = 15,        /* sched:sched_process_exec, compiled only for tests (MCP_TEST_TP_RAW_EXEC) */
};

struct mcp_ev_tp_raw {
	struct mcp_hdr h;         /* the task that ran the tracepoint (for an Xid, often the driver's irq thread) */
	__u32 kind;               /* a capability's enum mcp_tp_kind_* */
	__u32 len;                /* bytes of data read: MCP_TP_RAW_LEN, or MCP_TP_RAW_MIN after a failed read */
	__u8 data[MCP_TP_RAW_LEN];/* the tracepoint record, its 8-byte common header zeroed (the kernel
	                           * keeps a pt_regs pointer there for BPF); stale bytes past its end */
};

/* ---- per-CPU health counters (map stats), exported as agent metrics. Each family numbers its own
 * from a base of its own, a multiple of 32 (common 0, requests 32, reclaim 64, cuda 96, http 160),
 * so that one family's new counter cannot move another's ---- */
enum mcp_stat_common {
	MCP_STAT_RB_LOST = 0,             /* ring buffer full: record not sent */
	MCP_STAT_PROC_MAP_FULL,           /* per-process counters map full */
	MCP_STAT_BUDGET_MAP_FULL,         /* begin refused: no budget entry could be made */
	MCP_STAT_SWITCH_IN_UNSEEN,        /* a traced thread's slice whose switch-in sched_switch did not see: counted from the CPU's last switch */
	MCP_STAT_WATCH_UID_FULL,          /* process not watched by the kernel (a watched one's child, an exec'd process.comms name): its uid holds MCP_WATCH_KERNEL_PER_UID */
	MCP_STAT_WATCH_MAP_FULL,          /* process not watched by the kernel: watch_tgid or watch_heirs full */
	MCP_STAT_TP_READ_SHORT,           /* raw tracepoint copy: the MCP_TP_RAW_LEN read failed, MCP_TP_RAW_MIN kept */
	MCP_STAT_TP_READ_FAIL,            /* raw tracepoint copy: no byte of the record readable, nothing sent */
	MCP_STAT_MAX = 256,               /* the stats array's size: past the last range */
};

#endif
