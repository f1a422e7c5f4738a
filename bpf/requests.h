/* Marked requests (requests.bpf.c, agent/requests): the marker's wire format, the per-thread and
 * per-process state of open requests, the owner budgets, off- and on-CPU bookkeeping, and the
 * request records. */
#ifndef MCP_REQUESTS_H
#define MCP_REQUESTS_H

#include "common.h"

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

enum mcp_event_type {
	MCP_EV_REQ_BEGIN = 1,
	MCP_EV_REQ_END = 2,
	MCP_EV_PROC_EXIT = 3,
};

enum mcp_end_reason {
	MCP_END_MARKED = 0,     /* the thread marked the end */
	MCP_END_SUPERSEDED = 1, /* a new begin on the same thread before an end */
	MCP_END_THREAD_EXIT = 2,/* the thread exited inside the request */
	MCP_END_ID_MISMATCH = 3,/* end carried another request id than the open one */
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

enum mcp_stat_requests {
	MCP_STAT_MARK_FAULT = 32,         /* marker argument unreadable */
	MCP_STAT_MARK_BAD,                /* bad magic, version or op */
	MCP_STAT_BEGIN_CAP,               /* begin refused: process at its open-request cap */
	MCP_STAT_BEGIN_RATE,              /* begin refused: process over its begin rate */
	MCP_STAT_BEGIN_MAP_FULL,          /* begin refused: request map full */
	MCP_STAT_BEGIN_SUPERSEDED,        /* begin on a thread with an open request */
	MCP_STAT_END_NO_BEGIN,            /* end on a thread with no open request */
	MCP_STAT_END_MISMATCH,            /* end with another request id */
	MCP_STAT_MARK_DENIED,             /* marker from a uid/cgroup not in requests.mark_users/mark_cgroups */
	MCP_STAT_BEGIN_UID_RATE,          /* begin refused: its uid over requests.max_begins_per_s_per_uid */
	MCP_STAT_BEGIN_CGROUP_RATE,       /* begin refused: its cgroup over requests.max_begins_per_s_per_cgroup */
	MCP_STAT_BEGIN_UID_OPEN,          /* begin refused: its uid at requests.max_open_per_uid */
	MCP_STAT_BEGIN_CGROUP_OPEN,       /* begin refused: its cgroup at requests.max_open_per_cgroup */
	MCP_STAT_BEGIN_UID_PROCS,         /* begin refused: its uid at requests.max_procs_per_uid marking processes */
	MCP_STAT_BEGIN_CGROUP_PROCS,      /* begin refused: its cgroup at requests.max_procs_per_cgroup */
	MCP_STAT_RB_REQ_LOST,             /* request ring buffer full: BEGIN/END/stall record not sent */
	MCP_STAT_BEGIN_PRESSURE,          /* begin refused: the reader is behind and its owner is past its share */
};

/* A thread's on-CPU slice (requests.bpf.c slice_take), the part of it while its process had a home
 * node and the part of that on another node (the slice hook, numa.bpf.c) */
struct mcp_slice {
	__u64 ns, homed, remote;
};

#endif
