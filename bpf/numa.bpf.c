/* NUMA locality: each traced thread's on-CPU slice against its process's home node, the node of its
 * GPUs (map numa_home, written by agent/numa for processes whose GPUs share one node; absent: no home,
 * the slice counts in oncpu_ns only). At sched_switch the CPU is still the one the thread ran on, and
 * a task does not migrate while running: one node for the whole slice (bpf_get_numa_node_id()). Run
 * through the slice and process_exit hooks (core/loader.py HOOKS) of requests.bpf.c's programs. */
#include "requests.h"

BPF_HASH(numa_home, u32, u32, MCP_MAX_PROCS);

static __always_inline void numa_slice(u32 tgid, struct mcp_slice *sl)
{
	u32 *home = numa_home.lookup(&tgid);
	if (home) {
		sl->homed = sl->ns;
		if (bpf_get_numa_node_id() != *home)
			sl->remote = sl->ns;
	}
}

static __always_inline void numa_gone(u32 tgid)
{
	numa_home.delete(&tgid);
}
