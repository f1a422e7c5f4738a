/* CUDA driver calls and NVIDIA ioctls, per request, per process and per zero-touch GPU step.
 *
 * Hooks: uprobes on libcuda.so exports (attached per library inode by agent/cuda/capability.py, which finds
 * every libcuda a process maps, containers included): entry-only counters on the launch paths,
 * entry+return pairs on context, sync and memory calls; syscalls:sys_enter_ioctl/sys_exit_ioctl
 * on the NVIDIA device fds of watched processes; sched:sched_process_exec (prompt rescans) and
 * sched:sched_process_exit (a thread that dies inside a call leaves no pending entry). Uprobe
 * registers and tracepoint fields only, never kernel struct offsets.
 *
 * Filtering: every hit costs one watch_tgid lookup; only watched (GPU, marked) processes do more.
 * The uprobes on exports also see calls made through the runtime: on driver 580 cuGetProcAddress
 * returned the exported symbols' addresses (docs/machines.md).
 *
 * Duty cycle: the governor (agent/cuda/governor.py) attaches each busy cuLaunchKernel* probe for a
 * slice and detaches it for (weight - 1) slices when its cost would exceed the overhead budget; each
 * hit then counts the symbol's weight (cu_config) in its process's counters (rate estimates, metrics)
 * and marks the counters `sampled` with it; a request or step counts the hit once (cu_add).
 */
#include "cuda.h"

/* tgid -> when it last exec'd (ns), written by the process_exec hook (core/loader.py HOOKS):
 * agent/cuda rereads the maps of those soon (a container's libcuda is another inode, attached only
 * once a process maps it) */
BPF_TABLE("lru_hash", u32, u64, cu_exec, 1024);

static __always_inline void cuda_exec(u32 tgid, u64 now)
{
	cu_exec.update(&tgid, &now);
}
#include <uapi/linux/ptrace.h>  /* struct pt_regs, PT_REGS_RC */

#define MCP_CU_HIST_SLOTS 48 /* log2(ns) buckets: up to ~39 h */

BPF_ARRAY(cu_config, u64, MCP_CFG_MAX);
BPF_TABLE("lru_hash", struct mcp_cu_pend_key, struct mcp_cu_pend, cu_pending, MCP_MAX_THREADS);
BPF_TABLE("lru_hash", u32, struct mcp_cu_thread, cu_thread, MCP_MAX_THREADS);
BPF_PERCPU_ARRAY(cu_zero, struct mcp_cu_thread, 1); /* never written: a zero value off the stack */
BPF_HASH(cu_hist, struct mcp_hist_key, u64, 16384);
BPF_HASH(nv_fds, struct mcp_nv_fd_key, u32, 65536);
BPF_TABLE("lru_hash", u32, struct mcp_nv_ioctl_start, nv_ioctl_start, MCP_MAX_THREADS);
BPF_HASH(nv_cmd, struct mcp_nv_cmd_key, struct mcp_nv_cmd_val, 8192);

static __always_inline u64 cu_cfg(u32 idx)
{
	u64 *v = cu_config.lookup(&idx);
	return v ? *v : 0;
}

/* Uprobes fire only in processes that map libcuda: with process.watch = gpu, the first call of
 * one the agent has not seen yet puts it in the watch set, so its counts start exactly there. */
static __always_inline int cu_watched(u32 tgid)
{
	if (watched(tgid))
		return 1;
	if (!cu_cfg(MCP_CFG_AUTO_WATCH))
		return 0;
	/* a trusted libcuda's uprobe fired in it: a GPU process by the driver's own code, not a path
	 * name; the bit too, so that its HTTP requests are followed from this call on */
	if (watch_add(tgid, 0, 0))
		stat_inc(MCP_STAT_CU_AUTO_WATCH);
	return 1;
}

static __always_inline struct mcp_cu_thread *cu_thread_get(u32 tid, u32 tgid)
{
	struct mcp_cu_thread *t = cu_thread.lookup(&tid);
	if (t)
		return t;
	u32 zero = 0;
	struct mcp_cu_thread *z = cu_zero.lookup(&zero);
	if (!z || cu_thread.update(&tid, z) != 0) {
		stat_inc(MCP_STAT_CU_MAP_FULL);
		return 0;
	}
	t = cu_thread.lookup(&tid);
	if (t) {
		t->step_begin_ns = bpf_ktime_get_ns();
		t->tgid = tgid;
	}
	return t;
}

/* n at offset off_n and ns at off_ns: to the thread's open request, else to its zero-touch step
 * state (one per hit: n_thread); and to its process (n, weighted). Only the thread itself writes its
 * request and step entries. A request's launches stay unweighted hits: user space knows when the
 * probe was on during the request (agent/cuda/coverage.py) and says exact, estimate or unknown;
 * weighted, a request inside an on-slice would read weight x its launches. */
static __always_inline void cu_add(u32 tid, u32 tgid, u32 off_n, u64 n_thread, u64 n, u32 off_ns, u64 ns,
				   u64 sampled)
{
	struct mcp_counters *c;
	struct mcp_req_state *st = req_by_tid.lookup(&tid);
	if (st) {
		c = &st->c;
	} else {
		struct mcp_cu_thread *t = cu_thread_get(tid, tgid);
		c = t ? &t->c : 0;
	}
	if (c) {
		*MCP_FIELD(c, off_n) += n_thread;
		if (ns)
			*MCP_FIELD(c, off_ns) += ns;
		if (sampled)
			c->sampled = sampled;
	}
	c = proc_counters(tgid);
	if (c) {
		__sync_fetch_and_add(MCP_FIELD(c, off_n), n);
		if (ns)
			__sync_fetch_and_add(MCP_FIELD(c, off_ns), ns);
		if (sampled)
			c->sampled = sampled;
	}
	/* A zero-code request's thread and serving group (agent/http takes their differences): the hits
	 * as a marked request counts them (unweighted: its coverage makes the estimate), only where
	 * those counters are kept (a watched thread's; a group with HTTP requests) */
	c = thread_stats.lookup(&tid);
	if (c) {
		*MCP_FIELD(c, off_n) += n_thread;
		if (ns)
			*MCP_FIELD(c, off_ns) += ns;
	}
	u64 g = serving_group();
	c = g ? group_stats.lookup(&g) : 0;
	if (c) {
		__sync_fetch_and_add(MCP_FIELD(c, off_n), n_thread);
		if (ns)
			__sync_fetch_and_add(MCP_FIELD(c, off_ns), ns);
	}
}

static __always_inline void hist_add(u32 tgid, u32 kind, u64 d)
{
	struct mcp_hist_key k = {.tgid = tgid, .kind = kind, .slot = bpf_log2l(d)};
	if (k.slot >= MCP_CU_HIST_SLOTS)
		k.slot = MCP_CU_HIST_SLOTS - 1;
	cu_hist.atomic_increment(k);
}

/* weight_idx: the symbol's cu_config slot, or MCP_CFG_MAX for a probe never duty-cycled */
static __always_inline int cu_launch_hit(u32 off, u32 weight_idx)
{
	u64 pid_tgid = bpf_get_current_pid_tgid();
	u32 tgid = pid_tgid >> 32;
	u64 w = weight_idx < MCP_CFG_MAX ? cu_cfg(weight_idx) : 1;
	if (w == 0)
		w = 1;
	if (weight_idx < MCP_CFG_MAX) {
		u32 idx = MCP_STAT_CU_LAUNCH_HITS;
		u64 *v = stats.lookup(&idx);
		if (v)
			*v += w;
	}
	if (!cu_watched(tgid))
		return 0;
	cu_add((u32)pid_tgid, tgid, off, 1, w, off, 0, w > 1 ? w : 0);
	return 0;
}

static __always_inline int cu_enter(u32 family, u32 kind)
{
	u64 pid_tgid = bpf_get_current_pid_tgid();
	if (!cu_watched(pid_tgid >> 32))
		return 0;
	struct mcp_cu_pend_key k = {.tid = (u32)pid_tgid, .family = family};
	struct mcp_cu_pend p = {.ts_ns = bpf_ktime_get_ns(), .kind = kind};
	if (cu_pending.update(&k, &p) != 0)
		stat_inc(MCP_STAT_CU_MAP_FULL);
	return 0;
}

/* A sync returned: outside a request it closes the thread's GPU step, begun at its previous sync
 * return. Only steps with launches are sent (a thread polling an event sends nothing); inside a
 * request the step state restarts, so a step never carries a request's work. */
static __always_inline void cu_step(u64 pid_tgid, u64 now, u64 d, u32 kind, int in_request)
{
	u32 tid = (u32)pid_tgid;
	struct mcp_cu_thread *t = cu_thread.lookup(&tid);
	if (!t)
		return;
	struct mcp_counters *c = &t->c;
	if (!in_request && (c->cu_launch | c->cu_launch_ptsz | c->cu_launch_ex | c->cu_launch_ex_ptsz | c->cu_graph_launch)) {
		struct mcp_ev_gpu_step *e = events.ringbuf_reserve(sizeof(*e));
		if (e) {
			fill_hdr(&e->h, MCP_EV_GPU_STEP, sizeof(*e), pid_tgid, now);
			e->begin_ns = t->step_begin_ns;
			e->sync_ns = d;
			e->sync_kind = kind;
			e->pad = 0;
			e->c = *c;
			events.ringbuf_submit(e, 0);
		} else {
			stat_inc(MCP_STAT_RB_LOST);
		}
	}
	__builtin_memset(c, 0, sizeof(*c));
	t->step_begin_ns = now;
}

static __always_inline int cu_return(u32 family, u32 hist, u32 off_n, u32 off_ns)
{
	u64 pid_tgid = bpf_get_current_pid_tgid();
	u32 tid = (u32)pid_tgid, tgid = pid_tgid >> 32;
	struct mcp_cu_pend_key k = {.tid = tid, .family = family};
	struct mcp_cu_pend *p = cu_pending.lookup(&k);
	if (!p) {
		if (watched(tgid))
			stat_inc(MCP_STAT_CU_PAIR_MISS);
		return 0;
	}
	u64 now = bpf_ktime_get_ns();
	u64 d = now - p->ts_ns;
	u32 kind = p->kind;
	cu_pending.delete(&k);
	u64 bound = cu_cfg(MCP_CFG_MAX_CALL_NS);
	if (bound && d > bound) {
		stat_inc(MCP_STAT_CU_PAIR_STALE);
		return 0;
	}
	hist_add(tgid, hist, d);
	cu_add(tid, tgid, off_n, 1, 1, off_ns, d, 0);
	if (family == MCP_CU_SYNC)
		cu_step(pid_tgid, now, d, kind, req_by_tid.lookup(&tid) != 0);
	return 0;
}

#if MCP_PROBE_CUDA_LAUNCH
int cu_launch(struct pt_regs *ctx) { return cu_launch_hit(MCP_OFF(cu_launch), MCP_CFG_WEIGHT_LAUNCH); }
int cu_launch_ptsz(struct pt_regs *ctx) { return cu_launch_hit(MCP_OFF(cu_launch_ptsz), MCP_CFG_WEIGHT_LAUNCH_PTSZ); }
int cu_launch_ex(struct pt_regs *ctx) { return cu_launch_hit(MCP_OFF(cu_launch_ex), MCP_CFG_WEIGHT_LAUNCH_EX); }
int cu_launch_ex_ptsz(struct pt_regs *ctx) { return cu_launch_hit(MCP_OFF(cu_launch_ex_ptsz), MCP_CFG_WEIGHT_LAUNCH_EX_PTSZ); }
#endif /* MCP_PROBE_CUDA_LAUNCH */

#if MCP_PROBE_CUDA_GRAPH
/* one per graph replay, however many kernels the graph holds; never duty-cycled (low rate) */
int cu_graph_launch(struct pt_regs *ctx) { return cu_launch_hit(MCP_OFF(cu_graph_launch), MCP_CFG_MAX); }
#endif /* MCP_PROBE_CUDA_GRAPH */

#if MCP_PROBE_CUDA_CTX
int cu_ctx_enter(struct pt_regs *ctx) { return cu_enter(MCP_CU_CTX, 0); }
int cu_ctx_ret(struct pt_regs *ctx) { return cu_return(MCP_CU_CTX, MCP_HIST_CTX, MCP_OFF(cu_ctx_ops), MCP_OFF(cu_ctx_ns)); }
#endif /* MCP_PROBE_CUDA_CTX */

#if MCP_PROBE_CUDA_SYNC
int cu_sync_stream_enter(struct pt_regs *ctx) { return cu_enter(MCP_CU_SYNC, MCP_CU_SYNC_STREAM); }
int cu_sync_ctx_enter(struct pt_regs *ctx) { return cu_enter(MCP_CU_SYNC, MCP_CU_SYNC_CTX); }
int cu_sync_event_enter(struct pt_regs *ctx) { return cu_enter(MCP_CU_SYNC, MCP_CU_SYNC_EVENT); }
int cu_sync_ret(struct pt_regs *ctx) { return cu_return(MCP_CU_SYNC, MCP_HIST_SYNC, MCP_OFF(cu_syncs), MCP_OFF(cu_sync_ns)); }
#endif /* MCP_PROBE_CUDA_SYNC */

#if MCP_PROBE_CUDA_ALLOC
int cu_alloc_enter(struct pt_regs *ctx) { return cu_enter(MCP_CU_ALLOC, 0); }
int cu_alloc_ret(struct pt_regs *ctx)
{
	/* CUresult is an int, returned in the return register (regs->ax on x86-64: PT_REGS_RC, from
	 * uapi/linux/ptrace.h as bcc's tools include it); 2 = CUDA_ERROR_OUT_OF_MEMORY (cuda.h) */
	if ((int)PT_REGS_RC(ctx) == 2) {
		u64 pid_tgid = bpf_get_current_pid_tgid();
		u32 tgid = pid_tgid >> 32;
		if (cu_watched(tgid))
			cu_add((u32)pid_tgid, tgid, MCP_OFF(cu_alloc_oom), 1, 1, MCP_OFF(cu_alloc_oom), 0, 0);
	}
	return cu_return(MCP_CU_ALLOC, MCP_HIST_ALLOC, MCP_OFF(cu_allocs), MCP_OFF(cu_alloc_ns));
}
#endif /* MCP_PROBE_CUDA_ALLOC */

#if MCP_PROBE_CUDA_FREE
int cu_free_enter(struct pt_regs *ctx) { return cu_enter(MCP_CU_FREE, 0); }
int cu_free_ret(struct pt_regs *ctx) { return cu_return(MCP_CU_FREE, MCP_HIST_FREE, MCP_OFF(cu_frees), MCP_OFF(cu_free_ns)); }
#endif /* MCP_PROBE_CUDA_FREE */

#if MCP_PROBE_NVIDIA_IOCTL
/* The syscall tracepoints' records (kernel/trace/trace_syscalls.c: an 8-byte trace_entry, int nr,
 * then each argument in 8 bytes). Declared here, not through bcc's TRACEPOINT_PROBE, because the
 * marker already owns tracepoint__syscalls__sys_enter_ioctl and bcc 0.26 generates that struct
 * once per unit (a second function naming it fails: "redefinition"); agent/cuda/ioctl.py checks these
 * offsets against tracefs before attaching. */
struct mcp_sys_enter_ioctl {
	u64 common;
	s32 nr;
	u32 pad;
	u64 fd;
	u64 cmd;
	u64 arg;
};

/* Which fds are NVIDIA's is decided in user space (nv_fds, from /proc/PID/fd): the ioctl type byte
 * cannot pick out nvidia-uvm, whose commands are bare numbers (type 0x00), and resolving fd -> file
 * in BPF would read kernel structs (task->files), unsafe with near-miss headers. */
int nv_ioctl_enter(struct mcp_sys_enter_ioctl *args)
{
	u64 pid_tgid = bpf_get_current_pid_tgid();
	u32 tgid = pid_tgid >> 32, tid = (u32)pid_tgid;
	if (!watched(tgid))
		return 0;
	struct mcp_nv_fd_key k = {.tgid = tgid, .fd = (u32)args->fd};
	u32 *dev = nv_fds.lookup(&k);
	if (!dev)
		return 0;
	struct mcp_nv_ioctl_start s = {.ts_ns = bpf_ktime_get_ns(), .cmd = (u32)args->cmd, .dev = *dev};
	nv_ioctl_start.update(&tid, &s);
	return 0;
}

int nv_ioctl_exit(void *ctx)
{
	u64 pid_tgid = bpf_get_current_pid_tgid();
	u32 tgid = pid_tgid >> 32, tid = (u32)pid_tgid;
	struct mcp_nv_ioctl_start *s = nv_ioctl_start.lookup(&tid);
	if (!s)
		return 0;
	u64 d = bpf_ktime_get_ns() - s->ts_ns;
	struct mcp_nv_cmd_key ck = {.tgid = tgid, .cmd = s->cmd, .dev = s->dev};
	nv_ioctl_start.delete(&tid);
	hist_add(tgid, MCP_HIST_IOCTL, d);
	cu_add(tid, tgid, MCP_OFF(nv_ioctls), 1, 1, MCP_OFF(nv_ioctl_ns), d, 0);
	struct mcp_nv_cmd_val zero = {};
	nv_cmd.insert(&ck, &zero);
	struct mcp_nv_cmd_val *v = nv_cmd.lookup(&ck);
	if (v) {
		__sync_fetch_and_add(&v->count, 1);
		__sync_fetch_and_add(&v->ns, d);
	}
	return 0;
}
#endif /* MCP_PROBE_NVIDIA_IOCTL */


#if MCP_PROBE_CUDA_THREAD_EXIT
/* A thread that dies inside a call never returns through its uretprobe: drop its pending entries,
 * so that a later return on a reused tid cannot pair with them. Named apart from requests.bpf.c's
 * tracepoint__sched__sched_process_exit; attached by agent/cuda/capability.py. */
int cuda_thread_exit(void *ctx)
{
	u32 tid = (u32)bpf_get_current_pid_tgid();
	struct mcp_cu_pend_key k = {.tid = tid};
	for (u32 f = 0; f < MCP_CU_FAMILIES; f++) {
		k.family = f;
		cu_pending.delete(&k);
	}
	cu_thread.delete(&tid);
	nv_ioctl_start.delete(&tid);
	return 0;
}
#endif /* MCP_PROBE_CUDA_THREAD_EXIT */
