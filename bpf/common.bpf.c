/* Maps, settings and helpers shared by every probe family. agent/core/loader.py compiles one unit:
 * this file first, then requests.bpf.c, http.bpf.c, reclaim.bpf.c, cuda.bpf.c, health.bpf.c (each probe under #if
 * MCP_PROBE_<NAME>), so that every family can add to the same per-request and per-process counters.
 *
 * Settings arrive as -D cflags from agent/core/loader.py: MCP_MAX_OPEN_PER_PID, MCP_MAX_BEGINS_PER_S,
 * the owner budgets MCP_{MAX_BEGINS_PER_S,MAX_OPEN,MAX_PROCS}_{UID,CGROUP} and MCP_MARK_RESTRICT,
 * MCP_WATCH_ALL, MCP_REQ_RINGBUF_PAGES, MCP_RINGBUF_PAGES, MCP_MAX_THREADS, MCP_MAX_PROCS, MCP_STALL_THRESHOLD_NS,
 * MCP_PAGE_SIZE and MCP_FILEMAP_ORDER (agent/requests/capability.py), and
 * MCP_PROBE_<NAME>=1 for each probe whose hook this kernel has (bcc needs a tracepoint's format to
 * compile its probe).
 */
#include "common.h"
#include "requests.h"  /* the request windows every family adds its counters to */

/* bpf_probe_read_user/_kernel, called through their helper ids under names of our own. bcc 0.26's
 * rewriter checks every call site of those two names against /proc/kallsyms (to fall back to
 * bpf_probe_read on kernels older than 5.5), loading all of kallsyms (~120k symbols) per site:
 * ~0.1 s of compile per call, most of http.bpf.c's compile time. The ring buffers already need 5.8. */
static long (*mcp_read_user)(void *dst, u32 size, const void *src) = (void *)BPF_FUNC_probe_read_user;
static long (*mcp_read_kernel)(void *dst, u32 size, const void *src) = (void *)BPF_FUNC_probe_read_kernel;

#ifndef MCP_MAX_OPEN_PER_PID
#define MCP_MAX_OPEN_PER_PID 1024
#endif
#ifndef MCP_MAX_BEGINS_PER_S
#define MCP_MAX_BEGINS_PER_S 20000
#endif
/* Owner budgets: what all processes of one uid, and of one cgroup, may hold together. Defaults
 * leave most of req_by_tid (MCP_MAX_THREADS) and tgid_state (MCP_MAX_PROCS) to other owners. */
#ifndef MCP_MAX_BEGINS_PER_S_UID
#define MCP_MAX_BEGINS_PER_S_UID 20000
#endif
#ifndef MCP_MAX_BEGINS_PER_S_CGROUP
#define MCP_MAX_BEGINS_PER_S_CGROUP 20000
#endif
#ifndef MCP_MAX_OPEN_UID
#define MCP_MAX_OPEN_UID 2048
#endif
#ifndef MCP_MAX_OPEN_CGROUP
#define MCP_MAX_OPEN_CGROUP 2048
#endif
#ifndef MCP_MAX_PROCS_UID
#define MCP_MAX_PROCS_UID 256
#endif
#ifndef MCP_MAX_PROCS_CGROUP
#define MCP_MAX_PROCS_CGROUP 256
#endif
/* 1: only uids and cgroups in mark_allow may mark (requests.mark_users / mark_cgroups); they are
 * exempt from the owner budgets. 0: anyone may mark, within the budgets. */
#ifndef MCP_MARK_RESTRICT
#define MCP_MARK_RESTRICT 0
#endif
#ifndef MCP_REQ_RINGBUF_PAGES
#define MCP_REQ_RINGBUF_PAGES 256
#endif
/* The reader's lag (records in req_events not yet read) past which only owners within their share
 * (MCP_PRESSURE_BEGINS_PER_S in this window and the one before) may begin: a starved agent, or one behind a
 * flood, keeps room for light users instead of losing everyone's END records. Half the ring, counted
 * in the largest request record (struct mcp_ev_req_end, ~270 bytes with its 8-byte ring header). */
#define MCP_PRESSURE_LAG (MCP_REQ_RINGBUF_PAGES * 4096 / 2 / 288)
/* A light user's rate: under a lag, owners above it wait (requests.bpf.c, mark_begin). */
#ifndef MCP_PRESSURE_BEGINS_PER_S
#define MCP_PRESSURE_BEGINS_PER_S 100
#endif
/* cgroup v2 levels checked against mark_allow, from the root (level 0) down */
#define MCP_CGROUP_LEVELS 16
#define MCP_MAX_OWNERS 8192
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
#define MCP_MAX_GROUPS 1024
/* requests.group: 0 a request's serving group is its thread's cgroup; 1 the process tree it belongs to
 * (tree_root: a serving process is its own root, processes it forks inherit it) */
#ifndef MCP_GROUP_TREE
#define MCP_GROUP_TREE 0
#endif
#define MCP_TREE_GROUP (1ULL << 62)  /* a tree group's key: this bit | the root's tgid (cgroup ids are inode numbers, far below) */
/* A counter of struct mcp_counters by its byte offset: one helper serves several counters; the offset
 * must be a constant once the helper is inlined, as the verifier needs */
#define MCP_OFF(field) ((u32)__builtin_offsetof(struct mcp_counters, field))
#define MCP_FIELD(c, off) ((u64 *)((char *)(c) + (off)))
#ifndef MCP_PAGE_SIZE
#define MCP_PAGE_SIZE 4096
#endif
#ifndef MCP_FILEMAP_ORDER
#define MCP_FILEMAP_ORDER 0  /* 1: filemap:mm_filemap_add_to_page_cache has an order field */
#endif
#ifndef MCP_HTTP_RINGBUF_PAGES
#define MCP_HTTP_RINGBUF_PAGES 512
#endif

/* sched_switch's prev_state is TASK_REPORT_MAX (0x100 since v4.14) when the task was preempted:
 * include/trace/events/sched.h __trace_sched_switch_state(). 0 means it yielded while runnable.
 * Either way the kernel counts nivcsw; any other state is a voluntary switch (nvcsw). */
#define MCP_TASK_REPORT_MAX 0x100
/* A dying task's last switch reports its exit_state: EXIT_ZOMBIE or EXIT_DEAD (include/linux/sched.h,
 * __task_state_index()); nothing of it runs again. */
#define MCP_EXIT_DEAD 0x10
#define MCP_EXIT_ZOMBIE 0x20

BPF_RINGBUF_OUTPUT(events, MCP_RINGBUF_PAGES);
/* Request BEGIN/END, their reclaim stalls and the exits of marking processes only: bulk records
 * (other process exits, GPU steps, kswapd, health tracepoints, stalls outside requests), which any
 * local user can cause at will, cannot crowd them out of a shared buffer. */
BPF_RINGBUF_OUTPUT(req_events, MCP_REQ_RINGBUF_PAGES);
BPF_ARRAY(req_flow, u64, MCP_FLOW_MAX);
BPF_HASH(req_by_tid, u32, struct mcp_req_state, MCP_MAX_THREADS);
BPF_HASH(tgid_state, u32, struct mcp_tgid_state, MCP_MAX_PROCS);
BPF_HASH(proc_stats, u32, struct mcp_counters, MCP_MAX_PROCS);
BPF_HASH(watch_tgid, u32, u8, MCP_MAX_PROCS);
BPF_TABLE("lru_hash", u32, struct mcp_offcpu, offcpu_start, MCP_MAX_THREADS);
/* the thread on each CPU and its switch-in (or last slice split) time: requests.bpf.c slice_take */
BPF_PERCPU_ARRAY(cpu_run, struct mcp_cpu_run, 1);
BPF_PERCPU_ARRAY(stats, u64, MCP_STAT_MAX);
/* cgroup v2's root has id 1; MCP_ROOT_CGROUP_OWNER | uid keys a root-cgroup task's cgroup budget */
#define MCP_ROOT_CGROUP_ID 1
#define MCP_ROOT_CGROUP_OWNER (1ULL << 63)
/* LRU: owners come and go (every container is a new cgroup id). Evicting one takes MCP_MAX_OWNERS
 * newer owners; a user who can make that many uids or cgroups (subuid ranges, systemd-run --user
 * --scope) can, which docs/SECURITY.md says: the allow lists are the control that holds then. */
BPF_TABLE("lru_hash", struct mcp_owner_key, struct mcp_budget, budgets, MCP_MAX_OWNERS);
BPF_HASH(mark_allow, struct mcp_owner_key, u8, 1024);  /* written by the agent at start */
/* Counters of each thread of a watched process, and of each serving group (a cgroup whose thread
 * read an HTTP request head: http.bpf.c), for the differences between a request's BEGIN and END.
 * LRU: threads and groups come and go; an evicted one restarts at 0 and its requests' differences
 * say so (agent/http: a counter that went backwards). */
BPF_TABLE("lru_hash", u32, struct mcp_counters, thread_stats, MCP_MAX_THREADS);
BPF_TABLE("lru_hash", u64, struct mcp_counters, group_stats, MCP_MAX_GROUPS);
/* [0]: non-zero once a serving group exists, so that hosts without zero-code requests pay no
 * cgroup lookup per fault and switch */
BPF_ARRAY(groups_on, u32, 1);
BPF_TABLE("lru_hash", u32, u32, tree_root, MCP_MAX_PROCS * 4);  /* tgid -> its serving tree's root (MCP_GROUP_TREE) */
BPF_ARRAY(zero_counters, struct mcp_counters, 1);  /* a zero value to insert, off the 512-byte stack */
/* The watch set again, as a bitmap over tgids (pid_max is at most 2^22: PID_MAX_LIMIT), for the HTTP
 * probes that run on every read and write of the host: an array lookup the JIT inlines, where the
 * watch_tgid hash lookup cost ~100 ns a syscall here (bench/bench_http.py). agent/core/discovery.py
 * sets the bits with watch_tgid; a process's exit clears its own (requests.bpf.c). */
#define MCP_WATCH_BITS_WORDS (4194304 / 64)
BPF_ARRAY(watch_bits, u64, MCP_WATCH_BITS_WORDS);
/* The same for the processes the kernel adds itself (children of watched ones, an exec'd name in
 * process.comms, a first CUDA call), apart from watch_bits so that agent/core/discovery.py's rewrite of
 * a word never clears a bit it did not set. */
BPF_ARRAY(watch_bits_k, u64, MCP_WATCH_BITS_WORDS);
/* [0]: the agent's own tgid, written at start: never watched, even with process.watch = all (its
 * /metrics and control socket are not requests) */
BPF_ARRAY(self_tgid, u32, 1);
/* process.comms, written at start: a process that execs under one of these names is watched from then */
struct mcp_comm {
	char c[16];
};
BPF_HASH(watch_comms, struct mcp_comm, u8, 64);
/* Processes the kernel watched as a watched process's child or by their exec'd name -> the uid they are
 * charged to; each uid may have MCP_WATCH_KERNEL_PER_UID of them (a fork loop in a watched process
 * cannot fill watch_tgid for everyone) */
#ifndef MCP_WATCH_KERNEL_PER_UID
#define MCP_WATCH_KERNEL_PER_UID 1024
#endif
BPF_HASH(watch_heirs, u32, u32, MCP_MAX_PROCS);
BPF_HASH(watch_heir_uids, u32, u32, MCP_MAX_OWNERS);

static __always_inline void stat_inc(u32 idx)
{
	u64 *v = stats.lookup(&idx);
	if (v)
		(*v)++;
}

/* A record in req_events (req) or events: counted as produced in req_flow (enum mcp_req_flow: the
 * reader's lag) or as lost in the ring's own stat. */
static __always_inline void *rb_reserve(int req, u32 size)
{
	void *e = req ? req_events.ringbuf_reserve(size) : events.ringbuf_reserve(size);
	if (!e) {
		stat_inc(req ? MCP_STAT_RB_REQ_LOST : MCP_STAT_RB_LOST);
	} else if (req) {
		u32 k = MCP_FLOW_PRODUCED;
		u64 *v = req_flow.lookup(&k);
		if (v)
			__sync_fetch_and_add(v, 1);
	}
	return e;
}

static __always_inline int reader_behind(void)
{
	u32 kp = MCP_FLOW_PRODUCED, kc = MCP_FLOW_CONSUMED;
	u64 *p = req_flow.lookup(&kp), *c = req_flow.lookup(&kc);
	return p && c && *p > *c + MCP_PRESSURE_LAG;
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

static __always_inline int is_self(u32 tgid)
{
	u32 z = 0;
	u32 *me = self_tgid.lookup(&z);
	return me && *me == tgid;
}

static __always_inline int watched(u32 tgid)
{
	if (MCP_WATCH_ALL)
		return !is_self(tgid);
	return watch_tgid.lookup(&tgid) != 0;
}

static __always_inline struct mcp_counters *proc_counters(u32 tgid)
{
	struct mcp_counters *c = proc_stats.lookup(&tgid);
	if (c)
		return c;
	u32 z = 0;
	struct mcp_counters *zero = zero_counters.lookup(&z);  /* off the stack, as thread_counters */
	if (!zero)
		return 0;
	if (proc_stats.update(&tgid, zero) != 0) {
		stat_inc(MCP_STAT_PROC_MAP_FULL);
		return 0;
	}
	return proc_stats.lookup(&tgid);
}


/* A zero-initialised insert takes its value from zero_counters, not the stack (512 bytes in all).
 * bcc rewrites map.lookup() only where the map is named, hence one function per map. */
static __always_inline struct mcp_counters *thread_counters(u32 tid)
{
	struct mcp_counters *c = thread_stats.lookup(&tid);
	if (c)
		return c;
	u32 z = 0;
	struct mcp_counters *zero = zero_counters.lookup(&z);
	if (!zero)
		return 0;
	thread_stats.insert(&tid, zero);
	return thread_stats.lookup(&tid);
}

static __always_inline struct mcp_counters *group_counters(u64 g)
{
	struct mcp_counters *c = group_stats.lookup(&g);
	if (c)
		return c;
	u32 z = 0;
	struct mcp_counters *zero = zero_counters.lookup(&z);
	if (!zero)
		return 0;
	group_stats.insert(&g, zero);
	return group_stats.lookup(&g);
}

/* the current thread's serving group (its cgroup id, or its tree's key) when it has counters, else 0 */
static __always_inline u64 serving_group(void)
{
	u32 z = 0;
	u32 *on = groups_on.lookup(&z);
	if (!on || !*on)
		return 0;
	u64 cg;
	if (MCP_GROUP_TREE) {
		u32 tgid = bpf_get_current_pid_tgid() >> 32;
		u32 *root = tree_root.lookup(&tgid);
		if (!root)
			return 0;
		cg = MCP_TREE_GROUP | *root;
	} else {
		cg = bpf_get_current_cgroup_id();
	}
	/* not `lookup() ? cg : 0`: bcc's rewriter crashed clang on that form when headers were broken */
	struct mcp_counters *g = group_stats.lookup(&cg);
	if (!g)
		return 0;
	return cg;
}

static __always_inline int watched_bit(u32 tgid)
{
	if (MCP_WATCH_ALL)
		return !is_self(tgid);
	u32 i = tgid >> 6;
	u64 *w = watch_bits.lookup(&i);
	if (w && ((*w >> (tgid & 63)) & 1))
		return 1;
	w = watch_bits_k.lookup(&i);
	return w && ((*w >> (tgid & 63)) & 1);
}

static __always_inline void unwatch_bit(u32 tgid)
{
	u32 i = tgid >> 6;
	u64 *w = watch_bits.lookup(&i);
	if (w && ((*w >> (tgid & 63)) & 1))
		__sync_fetch_and_and(w, ~(1ULL << (tgid & 63)));
	w = watch_bits_k.lookup(&i);
	if (w && ((*w >> (tgid & 63)) & 1))
		__sync_fetch_and_and(w, ~(1ULL << (tgid & 63)));
}

/* The kernel puts tgid in the watch set (watch_tgid and its bit), charged to uid when heir (a
 * process.watch = gpu/marked/pids/comms choice the agent did not make itself). 0: refused, counted. */
static __always_inline int watch_add(u32 tgid, u32 uid, int heir)
{
	if (MCP_WATCH_ALL || is_self(tgid))
		return 0;
	if (heir) {
		u32 zero = 0;
		watch_heir_uids.insert(&uid, &zero);
		u32 *n = watch_heir_uids.lookup(&uid);
		if (!n || *n >= MCP_WATCH_KERNEL_PER_UID) {
			stat_inc(MCP_STAT_WATCH_UID_FULL);
			return 0;
		}
		if (watch_heirs.insert(&tgid, &uid) != 0) {
			stat_inc(MCP_STAT_WATCH_MAP_FULL);
			return 0;
		}
		__sync_fetch_and_add(n, 1);
	}
	u8 one = 1;
	if (watch_tgid.update(&tgid, &one) != 0) {
		stat_inc(MCP_STAT_WATCH_MAP_FULL);
		if (heir) {
			watch_heirs.delete(&tgid);
			u32 *n = watch_heir_uids.lookup(&uid);
			if (n && *n)
				__sync_fetch_and_add(n, -1);
		}
		return 0;
	}
	u32 i = tgid >> 6;
	u64 *w = watch_bits_k.lookup(&i);
	if (w)
		__sync_fetch_and_or(w, 1ULL << (tgid & 63));
	return 1;
}

/* A process's exit: the uid a kernel-made watch was charged to gets it back. */
static __always_inline void watch_heir_gone(u32 tgid)
{
	u32 *uid = watch_heirs.lookup(&tgid);
	if (!uid)
		return;
	u32 u = *uid;
	watch_heirs.delete(&tgid);
	u32 *n = watch_heir_uids.lookup(&u);
	if (n && *n)
		__sync_fetch_and_add(n, -1);
}

/* count -= n, not below 0. The counts are compared signed (see mark_begin): two CPUs racing past
 * the check can take one below 0, which reads as below its cap, never as a full one. */
static __always_inline void sat_sub(u32 *count, u32 n)
{
	if ((s32)*count > 0)
		__sync_fetch_and_add(count, -(s32)(n < *count ? n : *count));
}

/* A tracepoint's record, copied raw ("tracepoint_raw" probes): for events that come and go with a
 * module (nvidia) or a kernel config (CONFIG_PCIEAER, the PCIe port driver) and whose layouts change
 * between driver and kernel versions (aer_event's tlp_header grew from 4 to 14 words for flit mode).
 * bcc generates a TRACEPOINT_PROBE's argument struct from the format file at compile time, so these
 * probes are plain functions instead (tp_raw__<group>__<event>, in their capability's file): the
 * kernel side copies the record's first MCP_TP_RAW_LEN bytes and agent/core/rawtp.py decodes them
 * with the format it reads from tracefs at run time.
 *
 * ctx of a BPF_PROG_TYPE_TRACEPOINT program is the record itself, built in the per-CPU perf trace
 * buffer (perf_trace_buf_alloc(): PERF_MAX_TRACE_SIZE = 8192 bytes, the record at its start), so a
 * fixed-size read past the end of a shorter record stays inside that buffer; its __data_loc fields
 * tell user space where the record's own bytes end. The record's first 8 bytes (the common fields:
 * type, flags, preempt count, pid) are not there: perf_trace_run_bpf_submit() (kernel/events/core.c)
 * stores the pt_regs pointer over them before running the program (hence bcc's `u64
 * __do_not_use__`). They are zeroed here, so no kernel address reaches user space; the header's
 * tgid/tid say which task ran the tracepoint. */
static __always_inline int tp_raw_capture(void *ctx, u32 kind)
{
	u64 pid_tgid = bpf_get_current_pid_tgid();
	struct mcp_ev_tp_raw *e = events.ringbuf_reserve(sizeof(*e));
	if (!e) {
		stat_inc(MCP_STAT_RB_LOST);
		return 0;
	}
	fill_hdr(&e->h, MCP_EV_TP_RAW, sizeof(*e), pid_tgid, bpf_ktime_get_ns());
	e->kind = kind;
	e->len = MCP_TP_RAW_LEN;
	if (mcp_read_kernel(e->data, MCP_TP_RAW_LEN, ctx) != 0) {
		/* not expected (the buffer holds 8192 bytes); should it fault, a smaller read still
		 * carries the fixed fields, and user space clamps the strings that run past it */
		stat_inc(MCP_STAT_TP_READ_SHORT);
		e->len = MCP_TP_RAW_MIN;
		if (mcp_read_kernel(e->data, MCP_TP_RAW_MIN, ctx) != 0) {
			stat_inc(MCP_STAT_TP_READ_FAIL);
			events.ringbuf_discard(e, 0);
			return 0;
		}
	}
	*(u64 *)e->data = 0;
	events.ringbuf_submit(e, 0);
	return 0;
}

#if MCP_TEST_TP_RAW_EXEC
/* tests only (tests/gpuhealth/test_bpf_health.py): the same capture on sched:sched_process_exec, which every kernel
 * has and which carries a __data_loc string (filename), to prove capture and run-time decoding on
 * hosts without the health tracepoints. */
int tp_raw__sched__sched_process_exec(void *ctx) { return tp_raw_capture(ctx, MCP_TP_TEST_EXEC); }
#endif /* MCP_TEST_TP_RAW_EXEC */
