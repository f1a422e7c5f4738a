/* Maps, settings and helpers shared by every probe family. agent/loader.py compiles one unit:
 * this file first, then requests.bpf.c, reclaim.bpf.c, cuda.bpf.c, health.bpf.c (each probe under #if
 * MCP_PROBE_<NAME>), so that every family can add to the same per-request and per-process counters.
 *
 * Settings arrive as -D cflags from agent/loader.py: MCP_MAX_OPEN_PER_PID, MCP_MAX_BEGINS_PER_S,
 * MCP_WATCH_ALL, MCP_RINGBUF_PAGES, MCP_MAX_THREADS, MCP_MAX_PROCS, MCP_STALL_THRESHOLD_NS, and
 * MCP_PROBE_<NAME>=1 for each probe whose hook this kernel has (bcc needs a tracepoint's format to
 * compile its probe).
 */
#include "mcp_records.h"

#ifndef MCP_MAX_OPEN_PER_PID
#define MCP_MAX_OPEN_PER_PID 1024
#endif
#ifndef MCP_MAX_BEGINS_PER_S
#define MCP_MAX_BEGINS_PER_S 20000
#endif
#ifndef MCP_WATCH_ALL
#define MCP_WATCH_ALL 0
#endif
#ifndef MCP_RINGBUF_PAGES
#define MCP_RINGBUF_PAGES 256
#endif
#ifndef MCP_MAX_THREADS
#define MCP_MAX_THREADS 16384
#endif
#ifndef MCP_MAX_PROCS
#define MCP_MAX_PROCS 4096
#endif

/* sched_switch's prev_state is TASK_REPORT_MAX (0x100 since v4.14) when the task was preempted:
 * include/trace/events/sched.h __trace_sched_switch_state(). 0 means it yielded while runnable.
 * Either way the kernel counts nivcsw; any other state is a voluntary switch (nvcsw). */
#define MCP_TASK_REPORT_MAX 0x100

BPF_RINGBUF_OUTPUT(events, MCP_RINGBUF_PAGES);
BPF_HASH(req_by_tid, u32, struct mcp_req_state, MCP_MAX_THREADS);
BPF_HASH(tgid_state, u32, struct mcp_tgid_state, MCP_MAX_PROCS);
BPF_HASH(proc_stats, u32, struct mcp_counters, MCP_MAX_PROCS);
BPF_HASH(watch_tgid, u32, u8, MCP_MAX_PROCS);
BPF_TABLE("lru_hash", u32, struct mcp_offcpu, offcpu_start, MCP_MAX_THREADS);
BPF_PERCPU_ARRAY(stats, u64, MCP_STAT_MAX);

static __always_inline void stat_inc(u32 idx)
{
	u64 *v = stats.lookup(&idx);
	if (v)
		(*v)++;
}

static __always_inline void fill_hdr(struct mcp_hdr *h, u16 type, u16 size, u64 pid_tgid, u64 now)
{
	h->type = type;
	h->size = size;
	h->tgid = pid_tgid >> 32;
	h->tid = (u32)pid_tgid;
	h->cpu = bpf_get_smp_processor_id();
	h->ts_ns = now;
	h->cgroup_id = bpf_get_current_cgroup_id();
	bpf_get_current_comm(&h->comm, sizeof(h->comm));
}

static __always_inline int watched(u32 tgid)
{
	if (MCP_WATCH_ALL)
		return 1;
	return watch_tgid.lookup(&tgid) != 0;
}

static __always_inline struct mcp_counters *proc_counters(u32 tgid)
{
	struct mcp_counters zero = {};
	struct mcp_counters *c = proc_stats.lookup(&tgid);
	if (c)
		return c;
	if (proc_stats.update(&tgid, &zero) != 0) {
		stat_inc(MCP_STAT_PROC_MAP_FULL);
		return 0;
	}
	return proc_stats.lookup(&tgid);
}

