/* Request windows and their first counters, kept in the kernel.
 *
 * Hooks: syscalls:sys_enter_ioctl (request marker on fd -1), exceptions:page_fault_user,
 * sched:sched_switch, sched:sched_wakeup, sched:sched_process_exit. Reads only tracepoint fields and BPF helpers,
 * never kernel struct offsets, so near-miss kernel headers are safe.
 *
 * High-rate hooks (faults, switches) only add to map entries; the ring buffer carries request
 * begin/end and process exit, which are rare by comparison. Maps and helpers: common.bpf.c.
 */
#include "requests.h"

/* Off-CPU time: d ns, runnable (waiting for a CPU) or not, w ns of it after a wake-up (woke: 1) */
static __always_inline void offcpu_add(struct mcp_counters *c, u64 d, u32 runnable, u64 w, u64 woke)
{
	c->offcpu_ns += d;
	if (runnable)
		c->offcpu_runnable_ns += d;
	c->wakeup_wait_ns += w;
	c->wakeups += woke;
}

/* The same to counters threads on other CPUs share (a group's, a process's): atomic */
static __always_inline void offcpu_add_shared(struct mcp_counters *c, u64 d, u32 runnable, u64 w, u64 woke)
{
	__sync_fetch_and_add(&c->offcpu_ns, d);
	if (runnable)
		__sync_fetch_and_add(&c->offcpu_runnable_ns, d);
	if (woke) {
		__sync_fetch_and_add(&c->wakeup_wait_ns, w);
		__sync_fetch_and_add(&c->wakeups, 1);
	}
}

/* A thread's off-CPU interval, from its switch-out to end, goes to its counters (its entry goes) */
static __always_inline void offcpu_close(u32 tid, struct mcp_offcpu *o, u64 end)
{
	u64 d = end > o->ts_ns ? end - o->ts_ns : 0;
	u32 tgid = o->tgid, runnable = o->runnable, thread = o->thread;
	u64 g = o->group;
	/* woken after a sleep: the wait from the wake-up to end was on a run queue */
	u64 w = o->woken_ns && o->woken_ns <= end ? end - o->woken_ns : 0;
	u64 woke = o->woken_ns != 0;
	offcpu_start.delete(&tid);
	struct mcp_counters *c = thread ? thread_stats.lookup(&tid) : 0;
	if (c)
		offcpu_add(c, d, runnable, w, woke);
	struct mcp_req_state *st = req_by_tid.lookup(&tid);
	if (st)
		offcpu_add(&st->c, d, runnable, w, woke);
	c = g ? group_stats.lookup(&g) : 0;
	if (c)
		offcpu_add_shared(c, d, runnable, w, woke);
	c = proc_stats.lookup(&tgid);
	if (c)
		offcpu_add_shared(c, d, runnable, w, woke);
}

/* The slice the thread running on this CPU has had so far, split by NUMA locality, and the slot
 * restarted at now. At sched_switch the CPU is still the one prev ran on, and a task does not
 * migrate while running: one node for the whole slice. The slot is per CPU, not per thread, so a
 * thread traced mid-slice still has its start. Its switch-in not seen (the slot names another
 * thread): the kernel switched to it without sched:sched_switch, which on the sandboxes' kernels
 * happens after threads hidden from tracing; the slice counts from the CPU's last switch, an upper
 * bound (the hidden thread's time), and is counted in MCP_STAT_SWITCH_IN_UNSEEN; 2 then, until the
 * thread's switch-out, which closes its off-CPU interval at the slot's unseen_from. 0: no slice (the
 * slot not yet written by sched_switch, so with that probe off nothing counts wall time as CPU time;
 * whoever detaches it zeroes the slots, bench/_common.py ToggledAgent). */
static __always_inline int slice_take(u32 tid, u32 tgid, u64 now, struct mcp_slice *sl)
{
	int z = 0;
	struct mcp_cpu_run *r = cpu_run.lookup(&z);
	if (!r || !r->ts_ns || r->ts_ns > now)
		return 0;
	int unseen = r->tid != tid;
	u64 from = r->ts_ns;
	sl->ns = now - from;
	r->ts_ns = now;
	r->tid = tid;
	if (unseen) {
		stat_inc(MCP_STAT_SWITCH_IN_UNSEEN);
		/* the off-CPU interval before the unseen switch-in is still open: it ended no later than the
		 * CPU's previous switch. Closed at the thread's switch-out (sched_switch), where the stack
		 * has room for it; a request's edge may find the miss first. */
		r->unseen_from = from;
	}
	MCP_HOOK_SLICE(tgid, sl);  /* numa: the part of it on the process's home node and off it */
	return 1 + (r->unseen_from != 0);
}

/* A thread's own counters (its request's, its thread_stats entry): written only in its context */
static __always_inline void slice_add(struct mcp_counters *c, struct mcp_slice *sl)
{
	c->oncpu_ns += sl->ns;
	c->oncpu_homed_ns += sl->homed;
	c->oncpu_remote_ns += sl->remote;
}

/* Shared by the process's threads on other CPUs: atomic, and only the adds that change anything */
static __always_inline void proc_oncpu(struct mcp_counters *c, struct mcp_slice *sl)
{
	if (!sl->ns)
		return;
	__sync_fetch_and_add(&c->oncpu_ns, sl->ns);
	if (sl->homed)
		__sync_fetch_and_add(&c->oncpu_homed_ns, sl->homed);
	if (sl->remote)
		__sync_fetch_and_add(&c->oncpu_remote_ns, sl->remote);
}

/* A request's edge on a running thread: the slice so far goes to the counters (the request's too,
 * when st), and the rest of it starts now. Without it a request that never switches out (a CUDA
 * sync spins by default) would count no on-CPU time, and one that begins mid-slice the time before. */
static __always_inline void slice_split(u32 tid, u32 tgid, u64 now, struct mcp_req_state *st)
{
	struct mcp_slice sl = {};
	if (!slice_take(tid, tgid, now, &sl))
		return;
	if (st)
		slice_add(&st->c, &sl);
	if (watched(tgid)) {
		struct mcp_counters *c = proc_counters(tgid);
		if (c)
			proc_oncpu(c, &sl);
		c = thread_counters(tid);
		if (c)
			slice_add(c, &sl);
	}
}

static __always_inline void emit_end(u64 pid_tgid, u64 now, struct mcp_req_state *st, u32 reason)
{
	struct mcp_ev_req_end *e = rb_reserve(1, sizeof(*e));
	if (!e)
		return;
	fill_hdr(&e->h, MCP_EV_REQ_END, sizeof(*e), pid_tgid, now);
	e->request_id = st->request_id;
	e->begin_ns = st->begin_ns;
	e->reason = reason;
	e->pad = 0;
	e->c = st->c;
	req_events.ringbuf_submit(e, 0);
}

static __always_inline struct mcp_budget *owner_budget(u32 kind, u64 id, int create)
{
	struct mcp_owner_key k = {.kind = kind, .id = id};
	struct mcp_budget *b = budgets.lookup(&k);
	if (b || !create)
		return b;
	/* only when missing: an LRU insert takes a free node, and may evict a cold owner, even when
	 * the key exists */
	struct mcp_budget zero = {};
	budgets.insert(&k, &zero);
	return budgets.lookup(&k);
}


/* Give n open requests and, with procs, the process back to its two owners (after an LRU
 * eviction the entry is new and at 0: never below). */
static __always_inline void owners_release(struct mcp_tgid_state *ts, u32 open, int procs)
{
	if (ts->exempt)
		return;
	struct mcp_budget *b = owner_budget(MCP_OWNER_UID, ts->uid, 0);
	if (b) {
		if (open)
			sat_sub(&b->open, open);
		if (procs)
			sat_sub(&b->procs, 1);
	}
	b = owner_budget(MCP_OWNER_CGROUP, ts->cgroup_id, 0);
	if (b) {
		if (open)
			sat_sub(&b->open, open);
		if (procs)
			sat_sub(&b->procs, 1);
	}
}

static __always_inline void close_request(u32 tid, u32 tgid)
{
	/* only who deletes the entry gives the slot back: user space's idle expiry may race us */
	if (req_by_tid.delete(&tid) != 0)
		return;
	struct mcp_tgid_state *ts = tgid_state.lookup(&tgid);
	if (ts && (s32)ts->open > 0) {
		__sync_fetch_and_add(&ts->open, -1);
		owners_release(ts, 1, 0);
	}
}

/* requests.mark_users / mark_cgroups: the uid, or the cgroup or any of its ancestors (a unit's
 * cgroup covers the containers and scopes below it). */
static __always_inline int mark_allowed(u32 uid)
{
	struct mcp_owner_key k = {.kind = MCP_OWNER_UID, .id = uid};
	if (mark_allow.lookup(&k))
		return 1;
	k.kind = MCP_OWNER_CGROUP;
#pragma unroll
	for (int level = 0; level < MCP_CGROUP_LEVELS; level++) {
		k.id = bpf_get_current_ancestor_cgroup_id(level);
		if (k.id == 0)
			break;  /* past the thread's own level */
		if (mark_allow.lookup(&k))
			return 1;
	}
	return 0;
}

/* One-second windows: races between threads only blur the count by a few. */
/* prev (or 0): gets the ending window's count, or 0 when that window ended over a second ago */
static __always_inline int window_take(u64 *start, u32 *begins, u32 *prev, u32 max, u64 now)
{
	if (now - *start > 1000000000ULL) {
		if (prev)
			*prev = now - *start > 2000000000ULL ? 0 : *begins;
		*start = now;
		*begins = 0;
	}
	if (*begins >= max)
		return 0;
	(*begins)++;
	return 1;
}

/* The tgid_state of the marking process, made at its first begin within its owners' process caps. */
static __always_inline struct mcp_tgid_state *tgid_enter(u32 tgid, u32 uid, u64 cg, int exempt,
							 struct mcp_budget *bu, struct mcp_budget *bc)
{
	struct mcp_tgid_state *ts = tgid_state.lookup(&tgid);
	if (ts)
		return ts;
	if (!exempt) {
		if ((s32)bu->procs >= MCP_MAX_PROCS_UID) {
			stat_inc(MCP_STAT_BEGIN_UID_PROCS);
			return 0;
		}
		if ((s32)bc->procs >= MCP_MAX_PROCS_CGROUP) {
			stat_inc(MCP_STAT_BEGIN_CGROUP_PROCS);
			return 0;
		}
	}
	struct mcp_tgid_state fresh = {.uid = uid, .exempt = exempt, .cgroup_id = cg};
	/* BPF_NOEXIST: of two threads racing on the process's first begin, one charges its owners */
	if (tgid_state.insert(&tgid, &fresh) == 0 && !exempt) {
		__sync_fetch_and_add(&bu->procs, 1);
		__sync_fetch_and_add(&bc->procs, 1);
	}
	ts = tgid_state.lookup(&tgid);
	if (!ts)
		stat_inc(MCP_STAT_BEGIN_MAP_FULL);
	return ts;
}

static __always_inline int mark_begin(struct mcp_mark *m, u64 pid_tgid, u64 now)
{
	u32 tid = (u32)pid_tgid, tgid = pid_tgid >> 32;
	u32 uid = (u32)bpf_get_current_uid_gid();
	u64 cg = bpf_get_current_cgroup_id();
	/* Tasks in the root cgroup (and every task of a host without cgroup v2, where the id is the
	 * root's) share no cgroup budget: each uid there is a cgroup owner of its own. */
	if (cg <= MCP_ROOT_CGROUP_ID)
		cg = MCP_ROOT_CGROUP_OWNER | uid;
	struct mcp_budget *bu = 0, *bc = 0;
	int exempt = 0;

	if (MCP_MARK_RESTRICT) {
		if (!mark_allowed(uid)) {
			stat_inc(MCP_STAT_MARK_DENIED);
			return 0;
		}
		exempt = 1;
	} else {
		bu = owner_budget(MCP_OWNER_UID, uid, 1);
		bc = owner_budget(MCP_OWNER_CGROUP, cg, 1);
		if (!bu || !bc) {
			stat_inc(MCP_STAT_BUDGET_MAP_FULL);
			return 0;
		}
	}
	struct mcp_tgid_state *ts = tgid_enter(tgid, uid, cg, exempt, bu, bc);
	if (!ts)
		return 0;
	/* One-second windows per process, then per owner: a flood from one process, or from one
	 * user's many processes, cannot fill the ring buffer for everyone. */
	if (!window_take(&ts->window_start_ns, &ts->window_begins, 0, MCP_MAX_BEGINS_PER_S, now)) {
		stat_inc(MCP_STAT_BEGIN_RATE);
		return 0;
	}
	if (bu && !window_take(&bu->window_start_ns, &bu->window_begins, &bu->prev_begins, MCP_MAX_BEGINS_PER_S_UID, now)) {
		stat_inc(MCP_STAT_BEGIN_UID_RATE);
		return 0;
	}
	if (bc && !window_take(&bc->window_start_ns, &bc->window_begins, &bc->prev_begins, MCP_MAX_BEGINS_PER_S_CGROUP, now)) {
		stat_inc(MCP_STAT_BEGIN_CGROUP_RATE);
		return 0;
	}
	/* The reader is behind (starved of CPU, or behind a flood): the owners past their share this
	 * second or the one before wait, so that the ring keeps room for the END records of requests
	 * already begun and for light users. The second before counts too: with this one alone, each
	 * new window gave a flooding owner its share again (a begin and an END each), more than an agent
	 * starved by that flood reads, and the ring overflowed after a few seconds behind (CI). */
	if (bu && (bu->window_begins > MCP_PRESSURE_BEGINS_PER_S || bc->window_begins > MCP_PRESSURE_BEGINS_PER_S
		   || bu->prev_begins > MCP_PRESSURE_BEGINS_PER_S || bc->prev_begins > MCP_PRESSURE_BEGINS_PER_S)
	    && reader_behind()) {
		stat_inc(MCP_STAT_BEGIN_PRESSURE);
		return 0;
	}

	struct mcp_req_state *old = req_by_tid.lookup(&tid);
	slice_split(tid, tgid, now, old);
	if (old) {
		stat_inc(MCP_STAT_BEGIN_SUPERSEDED);
		emit_end(pid_tgid, now, old, MCP_END_SUPERSEDED);
	} else {
		if ((s32)ts->open >= MCP_MAX_OPEN_PER_PID) {
			stat_inc(MCP_STAT_BEGIN_CAP);
			return 0;
		}
		if (bu && (s32)bu->open >= MCP_MAX_OPEN_UID) {
			stat_inc(MCP_STAT_BEGIN_UID_OPEN);
			return 0;
		}
		if (bc && (s32)bc->open >= MCP_MAX_OPEN_CGROUP) {
			stat_inc(MCP_STAT_BEGIN_CGROUP_OPEN);
			return 0;
		}
	}

	struct mcp_req_state st = {};
	st.request_id = m->request_id;
	st.begin_ns = now;
	st.tgid = tgid;
	if (req_by_tid.update(&tid, &st) != 0) {
		stat_inc(MCP_STAT_BEGIN_MAP_FULL);
		if (old)
			close_request(tid, tgid);
		return 0;
	}
	if (!old) {
		__sync_fetch_and_add(&ts->open, 1);
		if (bu)
			__sync_fetch_and_add(&bu->open, 1);
		if (bc)
			__sync_fetch_and_add(&bc->open, 1);
	}

	if (!watched_bit(tgid))
		watch_add(tgid, uid, 0);

	struct mcp_ev_req_begin *e = rb_reserve(1, sizeof(*e));
	if (!e)
		return 0;
	fill_hdr(&e->h, MCP_EV_REQ_BEGIN, sizeof(*e), pid_tgid, now);
	e->request_id = m->request_id;
	__builtin_memcpy(e->traceparent, m->traceparent, MCP_TRACEPARENT_LEN);
	req_events.ringbuf_submit(e, 0);
	return 0;
}

static __always_inline int mark_end(struct mcp_mark *m, u64 pid_tgid, u64 now)
{
	u32 tid = (u32)pid_tgid, tgid = pid_tgid >> 32;
	struct mcp_req_state *st = req_by_tid.lookup(&tid);
	u32 reason = MCP_END_MARKED;

	if (!st) {
		stat_inc(MCP_STAT_END_NO_BEGIN);
		return 0;
	}
	if (m->request_id != 0 && m->request_id != st->request_id) {
		stat_inc(MCP_STAT_END_MISMATCH);
		reason = MCP_END_ID_MISMATCH;
	}
	slice_split(tid, tgid, now, st);
	emit_end(pid_tgid, now, st, reason);
	close_request(tid, tgid);
	return 0;
}

#if MCP_PROBE_MARKER
TRACEPOINT_PROBE(syscalls, sys_enter_ioctl)
{
	/* Every ioctl on the host passes here: two compares reject all but the marker. */
	if ((u32)args->fd != 0xffffffffU || (u32)args->cmd != MCP_MARK_CMD)
		return 0;

	struct mcp_mark m = {};
	if (mcp_read_user(&m, sizeof(m), (void *)args->arg) != 0) {
		stat_inc(MCP_STAT_MARK_FAULT);
		return 0;
	}
	if (m.magic != MCP_MARK_MAGIC || m.version != MCP_MARK_VERSION) {
		stat_inc(MCP_STAT_MARK_BAD);
		return 0;
	}
	u64 pid_tgid = bpf_get_current_pid_tgid();
	u64 now = bpf_ktime_get_ns();
	if (m.op == MCP_OP_BEGIN)
		return mark_begin(&m, pid_tgid, now);
	if (m.op == MCP_OP_END)
		return mark_end(&m, pid_tgid, now);
	stat_inc(MCP_STAT_MARK_BAD);
	return 0;
}
#endif /* MCP_PROBE_MARKER */

/* n more of the counter at off (MCP_OFF) for an event of the current thread's own (a fault, a
 * page-cache addition): its request's, and, where followed, its thread's, process's and serving group's */
static __always_inline void count_own(u32 off, u64 n)
{
	u64 pid_tgid = bpf_get_current_pid_tgid();
	u32 tid = (u32)pid_tgid, tgid = pid_tgid >> 32;
	struct mcp_req_state *st = req_by_tid.lookup(&tid);
	if (st)
		*MCP_FIELD(&st->c, off) += n;  /* only this thread writes its own request's */
	if (watched(tgid)) {
		struct mcp_counters *c = proc_counters(tgid);
		if (c)
			__sync_fetch_and_add(MCP_FIELD(c, off), n);
		c = thread_counters(tid);
		if (c)
			*MCP_FIELD(c, off) += n;
	}
	u64 g = serving_group();
	if (g) {
		struct mcp_counters *c = group_stats.lookup(&g);
		if (c)
			__sync_fetch_and_add(MCP_FIELD(c, off), n);
	}
}

#if MCP_PROBE_PAGE_FAULTS
TRACEPOINT_PROBE(exceptions, page_fault_user)
{
	count_own(MCP_OFF(faults), 1);
	return 0;
}
#endif /* MCP_PROBE_PAGE_FAULTS */

#if MCP_PROBE_PAGE_CACHE
/* A folio added to the page cache, in the context of the task that needed it (mm/filemap.c
 * __filemap_add_folio()): a read, readahead or file-mapping fault the cache missed, which the storage
 * layer then fills (a model loading from disk), or a new page of a buffered write. Every insertion
 * on the host passes here: two lookups for threads not followed. */
TRACEPOINT_PROBE(filemap, mm_filemap_add_to_page_cache)
{
#if MCP_FILEMAP_ORDER
	count_own(MCP_OFF(pagecache_added_bytes), (u64)MCP_PAGE_SIZE << (args->order & 31));
#else
	count_own(MCP_OFF(pagecache_added_bytes), MCP_PAGE_SIZE);
#endif
	return 0;
}
#endif /* MCP_PROBE_PAGE_CACHE */

#if MCP_PROBE_SCHED_SWITCH
TRACEPOINT_PROBE(sched, sched_switch)
{
	u64 now = bpf_ktime_get_ns();
	/* At this tracepoint current is still prev: its tgid comes from the helper. */
	u32 prev_tgid = bpf_get_current_pid_tgid() >> 32;
	u32 prev = args->prev_pid, next = args->next_pid;
	long state = args->prev_state;
	int voluntary = state != 0 && !(state & MCP_TASK_REPORT_MAX);
	int dying = (state & (MCP_EXIT_DEAD | MCP_EXIT_ZOMBIE)) && !(state & MCP_TASK_REPORT_MAX);
	int z = 0;
	struct mcp_cpu_run *r = cpu_run.lookup(&z);
	if (!r)
		return 0;

	if (prev != 0) {
		struct mcp_req_state *st = req_by_tid.lookup(&prev);
		int w = watched(prev_tgid);
		/* both as 0/1 registers: clang would otherwise test st || w as the OR of a map pointer,
		 * which the verifier refuses (pointer arithmetic before the null check) */
		int traced = st != 0;
		asm volatile("" : "+r"(w), "+r"(traced));
		struct mcp_slice sl = {};
		if ((traced || w) && !dying && slice_take(prev, prev_tgid, now, &sl) == 2) {
			struct mcp_offcpu *o = offcpu_start.lookup(&prev);
			if (o)
				offcpu_close(prev, o, r->unseen_from);
		}
		if (st) {
			if (voluntary)
				st->c.vcsw++;
			else
				st->c.ivcsw++;
			slice_add(&st->c, &sl);
		}
		if (w) {
			struct mcp_counters *c = proc_counters(prev_tgid);
			if (c) {
				if (voluntary)
					__sync_fetch_and_add(&c->vcsw, 1);
				else
					__sync_fetch_and_add(&c->ivcsw, 1);
				proc_oncpu(c, &sl);
			}
			c = thread_counters(prev);
			if (c) {
				if (voluntary)
					c->vcsw++;
				else
					c->ivcsw++;
				slice_add(c, &sl);
			}
		}
		u64 g = serving_group();  /* current is still prev: its cgroup */
		if (g) {
			struct mcp_counters *c = group_stats.lookup(&g);
			if (c) {
				if (voluntary)
					__sync_fetch_and_add(&c->vcsw, 1);
				else
					__sync_fetch_and_add(&c->ivcsw, 1);
			}
		}
		if (!dying && (st || w || g)) {
			struct mcp_offcpu o = {.ts_ns = now, .tgid = prev_tgid, .runnable = !voluntary, .group = g,
					       .thread = w};
			offcpu_start.update(&prev, &o);
		}
	}
	if (next != 0) {
		struct mcp_offcpu *o = offcpu_start.lookup(&next);
		if (o)
			offcpu_close(next, o, now);
	}
	/* next runs from now on this CPU (slice_take) */
	r->ts_ns = now;
	r->tid = next;
	r->unseen_from = 0;
	return 0;
}
#endif /* MCP_PROBE_SCHED_SWITCH */

/* A tracked thread that slept (its off-CPU entry says not runnable) is made runnable: from here to
 * its switch-in it waits on a run queue (kernel/sched/core.c ttwu_do_activate() fires the event once
 * the task is TASK_RUNNING and enqueued). Every wake-up of the host passes here: one LRU lookup. */
static __always_inline void wakeup(u32 pid)
{
	struct mcp_offcpu *o = offcpu_start.lookup(&pid);
	if (o && !o->runnable && !o->woken_ns)
		o->woken_ns = bpf_ktime_get_ns();
}

#if MCP_PROBE_SCHED_WAKEUP
TRACEPOINT_PROBE(sched, sched_wakeup)
{
	wakeup(args->pid);
	return 0;
}
#endif /* MCP_PROBE_SCHED_WAKEUP */

#if MCP_PROBE_WATCH_FORK
/* A new process (not a thread: CLONE_THREAD) of a watched one is watched from its first instruction,
 * before it runs (kernel/fork.c copy_process() fires task_newtask with current the parent): a
 * pre-fork server's re-forked worker (gunicorn --max-requests) is followed from its first accept.
 * requests.group = tree: a process forked in a serving tree joins it. */
#define MCP_CLONE_THREAD 0x00010000
TRACEPOINT_PROBE(task, task_newtask)
{
	if (args->clone_flags & MCP_CLONE_THREAD)
		return 0;
	u64 pid_tgid = bpf_get_current_pid_tgid();
	u32 parent = pid_tgid >> 32, child = args->pid;
	if (MCP_GROUP_TREE) {
		u32 *root = tree_root.lookup(&parent);
		if (root) {
			u32 r = *root;
			tree_root.update(&child, &r);
		}
	}
	if (!MCP_WATCH_ALL && watched_bit(parent))
		watch_add(child, (u32)bpf_get_current_uid_gid(), 1);
	return 0;
}
#endif /* MCP_PROBE_WATCH_FORK */

#if MCP_PROBE_PROCESS_EXEC
/* A new program image. Its name in process.comms: watched from its first syscall, not from the watch
 * scan's next round (comm is the new image's by now: fs/exec.c begin_new_exec()). And the capabilities'
 * process_exec hooks run (cuda: its maps reread soon). One program for all: bcc keeps one program per
 * tracepoint. */
TRACEPOINT_PROBE(sched, sched_process_exec)
{
	u64 pid_tgid = bpf_get_current_pid_tgid();
	u32 tgid = pid_tgid >> 32;
	u64 now = bpf_ktime_get_ns();
	MCP_HOOK_PROCESS_EXEC(tgid, now);
	if (MCP_WATCH_ALL || watched_bit(tgid))
		return 0;
	struct mcp_comm c = {};
	bpf_get_current_comm(&c.c, sizeof(c.c));
	if (watch_comms.lookup(&c))
		watch_add(tgid, (u32)bpf_get_current_uid_gid(), 1);
	return 0;
}
#endif /* MCP_PROBE_PROCESS_EXEC */

#if MCP_PROBE_PROCESS_EXIT
TRACEPOINT_PROBE(sched, sched_process_exit)
{
	u64 pid_tgid = bpf_get_current_pid_tgid();
	u32 tid = (u32)pid_tgid, tgid = pid_tgid >> 32;
	u64 now = bpf_ktime_get_ns();

	struct mcp_req_state *st = req_by_tid.lookup(&tid);
	/* The thread's last slice, from its switch-in to here: sched_switch takes no slice from a
	 * dying prev (its entries are gone by then), so without this a process that exits while
	 * running loses its final slice. Added to the process's counters only where they exist:
	 * creating them here would send an exit record for every watched process that never ran
	 * while watched (4,200 killed at once overflowed the ring and the exporter). */
	int w = watched(tgid), traced = st != 0;
	asm volatile("" : "+r"(w), "+r"(traced));  /* as in sched_switch: no OR of a map pointer */
	struct mcp_slice sl = {};
	if ((traced || w) && slice_take(tid, tgid, now, &sl)) {
		if (st)
			slice_add(&st->c, &sl);
		struct mcp_counters *pc = proc_stats.lookup(&tgid);
		if (pc)
			proc_oncpu(pc, &sl);
	}
	if (st) {
		emit_end(pid_tgid, now, st, MCP_END_THREAD_EXIT);
		close_request(tid, tgid);
	}
	offcpu_start.delete(&tid);
	thread_stats.delete(&tid);
	if (tid != tgid)
		return 0;

	/* The group leader exits last in exit_group(); its exit closes the process's entries. */
	struct mcp_tgid_state *ts = tgid_state.lookup(&tgid);
	struct mcp_counters *c = proc_stats.lookup(&tgid);
	if (c) {
		/* A process that marked requests: its exit goes in the ring its BEGIN and END records went
		 * in, so that the reader sees them in the order they happened (two rings have no order). */
		struct mcp_ev_proc_exit *e = rb_reserve(ts != 0, sizeof(*e));
		if (e) {
			fill_hdr(&e->h, MCP_EV_PROC_EXIT, sizeof(*e), pid_tgid, now);
			e->c = *c;
			bpf_ringbuf_submit(e, 0);
		}
		proc_stats.delete(&tgid);
	}
	watch_tgid.delete(&tgid);
	unwatch_bit(tgid);
	watch_heir_gone(tgid);
	tree_root.delete(&tgid);
	MCP_HOOK_PROCESS_EXIT(tgid);  /* the capabilities' per-process state (http's shares, numa's home) */
	if (ts) {
		/* Threads exit in no fixed order (the leader often first, at exit() or a signal): the
		 * requests still open in the others are given back with the process, here, since their
		 * close_request() will find no tgid_state. */
		owners_release(ts, ts->open, 1);
		tgid_state.delete(&tgid);
	}
	return 0;
}
#endif /* MCP_PROBE_PROCESS_EXIT */
