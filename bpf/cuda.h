/* CUDA driver calls and NVIDIA ioctls (cuda.bpf.c, agent/cuda/capability.py). */
#ifndef MCP_CUDA_H
#define MCP_CUDA_H
#include "common.h"

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

enum mcp_stat_cuda {
	MCP_STAT_CU_LAUNCH_HITS = 96,     /* cuLaunchKernel* uprobe hits x their weight, every process (the governor's host-wide rate) */
	MCP_STAT_CU_AUTO_WATCH,           /* processes put in the watch set by their first CUDA call (process.watch = gpu) */
	MCP_STAT_CU_PAIR_MISS,            /* CUDA call return with no recorded entry (attached mid-call, nested call) */
	MCP_STAT_CU_PAIR_STALE,           /* CUDA call entry older than the sanity bound: dropped, not measured */
	MCP_STAT_CU_MAP_FULL,             /* CUDA per-thread state not stored */
};

#endif
