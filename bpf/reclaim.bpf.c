/* Memory reclaim: who stalls in it, for how long, inside which request; when kswapd runs.
 *
 * Hooks: vmscan:mm_vmscan_direct_reclaim_begin/end, mm_vmscan_memcg_reclaim_begin/end (paired per
 * thread in reclaim_start), mm_vmscan_kswapd_wake/sleep (active intervals per node),
 * mm_vmscan_wakeup_kswapd (who woke it), mm_vmscan_lru_shrink_inactive (pages scanned/reclaimed,
 * by reclaimer). Tracepoint fields and helpers only.
 *
 * Only stalls of at least MCP_STALL_THRESHOLD_NS and kswapd wake/sleep cross the ring buffer; the
 * rest is summed in maps. Reclaim is rare next to faults, so every task is counted per tgid
 * (reclaim_by_tgid, LRU), not only watched ones: the stalled process is often not a GPU process.
 */
#include "reclaim.h"

#ifndef MCP_STALL_THRESHOLD_NS
#define MCP_STALL_THRESHOLD_NS 1000000
#endif
#define MCP_MAX_NODES 64
#define MCP_STALL_SLOTS 64 /* log2 buckets per reclaim kind */

BPF_HASH(reclaim_start, u32, struct mcp_reclaim_start, MCP_MAX_THREADS);
BPF_PERCPU_ARRAY(reclaim_totals, u64, MCP_RT_MAX);
BPF_TABLE("lru_hash", u32, struct mcp_counters, reclaim_by_tgid, MCP_MAX_PROCS);
BPF_ARRAY(kswapd_awake_since, u64, MCP_MAX_NODES); /* 0: asleep */
BPF_ARRAY(kswapd_active_ns, u64, MCP_MAX_NODES);   /* completed intervals, cumulative */
BPF_ARRAY(stall_hist, u64, 2 * MCP_STALL_SLOTS);   /* kind * MCP_STALL_SLOTS + log2(ns) */

static __always_inline void rt_add(u32 idx, u64 v)
{
	u64 *t = reclaim_totals.lookup(&idx);
	if (t)
		*t += v;
}

static __always_inline int reclaim_begin(u32 kind, int order, u64 gfp)
{
	u32 tid = (u32)bpf_get_current_pid_tgid();
	struct mcp_reclaim_start s = {.ts_ns = bpf_ktime_get_ns(), .gfp_flags = gfp, .order = order, .kind = kind};
	reclaim_start.update(&tid, &s);
	return 0;
}

static __always_inline void add_reclaim(struct mcp_counters *c, u32 kind, u64 d, u64 pages)
{
	if (kind == MCP_RECLAIM_DIRECT) {
		__sync_fetch_and_add(&c->direct_reclaims, 1);
		__sync_fetch_and_add(&c->direct_reclaim_ns, d);
	} else {
		__sync_fetch_and_add(&c->memcg_reclaims, 1);
		__sync_fetch_and_add(&c->memcg_reclaim_ns, d);
	}
	__sync_fetch_and_add(&c->reclaimed_pages, pages);
}

static __always_inline int reclaim_end(u32 kind, u64 nr_reclaimed)
{
	u64 pid_tgid = bpf_get_current_pid_tgid();
	u32 tid = (u32)pid_tgid, tgid = pid_tgid >> 32;
	struct mcp_reclaim_start *sp = reclaim_start.lookup(&tid);
	if (!sp || sp->kind != kind) {
		stat_inc(MCP_STAT_RECLAIM_NO_BEGIN);
		return 0;
	}
	struct mcp_reclaim_start s = *sp;
	reclaim_start.delete(&tid);
	u64 now = bpf_ktime_get_ns();
	u64 d = now - s.ts_ns;

	rt_add(kind == MCP_RECLAIM_DIRECT ? MCP_RT_DIRECT_NS : MCP_RT_MEMCG_NS, d);
	rt_add(kind == MCP_RECLAIM_DIRECT ? MCP_RT_DIRECTS : MCP_RT_MEMCGS, 1);
	u32 slot = kind * MCP_STALL_SLOTS + (u32)bpf_log2l(d);
	if (slot < 2 * MCP_STALL_SLOTS) {
		u64 *h = stall_hist.lookup(&slot);
		if (h)
			__sync_fetch_and_add(h, 1);
	}

	{
		/* scoped: its stack slot is free again for proc_counters' own zero (inlined below); both
		 * live at once would pass the 512-byte BPF stack once mcp_counters grew (MCP_WATCH_ALL) */
		struct mcp_counters zero = {};
		reclaim_by_tgid.insert(&tgid, &zero);
	}
	struct mcp_counters *pc = reclaim_by_tgid.lookup(&tgid);
	if (pc)
		add_reclaim(pc, kind, d, nr_reclaimed);
	if (watched(tgid)) {
		struct mcp_counters *c = proc_counters(tgid);
		if (c)
			add_reclaim(c, kind, d, nr_reclaimed);
		c = thread_stats.lookup(&tid);
		if (c)
			add_reclaim(c, kind, d, nr_reclaimed);
	}
	u64 g = serving_group();
	if (g) {
		struct mcp_counters *c = group_stats.lookup(&g);
		if (c)
			add_reclaim(c, kind, d, nr_reclaimed);
	}
	u64 request_id = 0;
	struct mcp_req_state *st = req_by_tid.lookup(&tid);
	if (st) {
		add_reclaim(&st->c, kind, d, nr_reclaimed);
		request_id = st->request_id;
	}

	if (d < MCP_STALL_THRESHOLD_NS)
		return 0;
	/* a request's stalls travel with its BEGIN and END, so that they reach the joiner before its END */
	struct mcp_ev_reclaim_stall *e = rb_reserve(request_id != 0, sizeof(*e));
	if (!e)
		return 0;
	fill_hdr(&e->h, MCP_EV_RECLAIM_STALL, sizeof(*e), pid_tgid, now);
	e->begin_ns = s.ts_ns;
	e->nr_reclaimed = nr_reclaimed;
	e->gfp_flags = s.gfp_flags;
	e->kind = kind;
	e->order = s.order;
	e->request_id = request_id;
	bpf_ringbuf_submit(e, 0);
	return 0;
}

#if MCP_PROBE_RECLAIM_DIRECT_BEGIN
TRACEPOINT_PROBE(vmscan, mm_vmscan_direct_reclaim_begin)
{
	return reclaim_begin(MCP_RECLAIM_DIRECT, args->order, args->gfp_flags);
}
#endif

#if MCP_PROBE_RECLAIM_DIRECT_END
TRACEPOINT_PROBE(vmscan, mm_vmscan_direct_reclaim_end)
{
	return reclaim_end(MCP_RECLAIM_DIRECT, args->nr_reclaimed);
}
#endif

#if MCP_PROBE_RECLAIM_MEMCG_BEGIN
TRACEPOINT_PROBE(vmscan, mm_vmscan_memcg_reclaim_begin)
{
	return reclaim_begin(MCP_RECLAIM_MEMCG, args->order, args->gfp_flags);
}
#endif

#if MCP_PROBE_RECLAIM_MEMCG_END
TRACEPOINT_PROBE(vmscan, mm_vmscan_memcg_reclaim_end)
{
	return reclaim_end(MCP_RECLAIM_MEMCG, args->nr_reclaimed);
}
#endif

static __always_inline void emit_kswapd(u32 nid, u32 awake, int order, u64 now)
{
	struct mcp_ev_kswapd *e = events.ringbuf_reserve(sizeof(*e));
	if (!e) {
		stat_inc(MCP_STAT_RB_LOST);
		return;
	}
	fill_hdr(&e->h, MCP_EV_KSWAPD, sizeof(*e), bpf_get_current_pid_tgid(), now);
	e->nid = nid;
	e->awake = awake;
	e->order = order;
	e->pad = 0;
	events.ringbuf_submit(e, 0);
}

#if MCP_PROBE_KSWAPD_WAKE
/* kswapd() traces a wake each time kswapd_try_to_sleep() returns, including after a short nap that
 * traced no sleep (mm/vmscan.c): a wake while already awake extends the interval. */
TRACEPOINT_PROBE(vmscan, mm_vmscan_kswapd_wake)
{
	u32 nid = args->nid;
	u64 now = bpf_ktime_get_ns();
	u64 *since = kswapd_awake_since.lookup(&nid);
	if (!since || *since != 0)
		return 0;
	*since = now;
	emit_kswapd(nid, 1, args->order, now);
	return 0;
}
#endif

#if MCP_PROBE_KSWAPD_SLEEP
TRACEPOINT_PROBE(vmscan, mm_vmscan_kswapd_sleep)
{
	u32 nid = args->nid;
	u64 now = bpf_ktime_get_ns();
	u64 *since = kswapd_awake_since.lookup(&nid);
	u64 *active = kswapd_active_ns.lookup(&nid);
	if (!since || !active || *since == 0)
		return 0;
	*active += now - *since;
	*since = 0;
	emit_kswapd(nid, 0, 0, now);
	return 0;
}
#endif

#if MCP_PROBE_WAKEUP_KSWAPD
TRACEPOINT_PROBE(vmscan, mm_vmscan_wakeup_kswapd)
{
	u64 pid_tgid = bpf_get_current_pid_tgid();
	u32 tid = (u32)pid_tgid, tgid = pid_tgid >> 32;
	rt_add(MCP_RT_KSWAPD_WAKEUPS, 1);
	struct mcp_req_state *st = req_by_tid.lookup(&tid);
	if (st)
		st->c.kswapd_wakeups++;
	if (watched(tgid)) {
		struct mcp_counters *c = proc_counters(tgid);
		if (c)
			__sync_fetch_and_add(&c->kswapd_wakeups, 1);
	}
	return 0;
}
#endif

#if MCP_PROBE_RECLAIM_SHRINK
/* Attribute pages to the reclaimer the way shrink_inactive_list() does for /proc/vmstat: kswapd by
 * its comm ("kswapdN"), otherwise the thread's open direct or memcg reclaim window. */
TRACEPOINT_PROBE(vmscan, mm_vmscan_lru_shrink_inactive)
{
	char comm[8] = {};
	bpf_get_current_comm(&comm, sizeof(comm));
	u32 scan, steal;
	if (comm[0] == 'k' && comm[1] == 's' && comm[2] == 'w' && comm[3] == 'a' && comm[4] == 'p' && comm[5] == 'd') {
		scan = MCP_RT_SCAN_KSWAPD;
		steal = MCP_RT_STEAL_KSWAPD;
	} else {
		u32 tid = (u32)bpf_get_current_pid_tgid();
		struct mcp_reclaim_start *s = reclaim_start.lookup(&tid);
		if (!s)
			return 0; /* khugepaged, proactive reclaim: not ours to attribute */
		scan = s->kind == MCP_RECLAIM_DIRECT ? MCP_RT_SCAN_DIRECT : MCP_RT_SCAN_MEMCG;
		steal = s->kind == MCP_RECLAIM_DIRECT ? MCP_RT_STEAL_DIRECT : MCP_RT_STEAL_MEMCG;
	}
	rt_add(scan, args->nr_scanned);
	rt_add(steal, args->nr_reclaimed);
	return 0;
}
#endif

#if MCP_PROBE_OOM_KILL
/* oom:mark_victim fires once per OOM kill, global or memcg (mm/oom_kill.c mark_oom_victim()); its
 * fields grew in 6.8 (total_vm, rss, uid, ...): copied raw and decoded at run time (agent/reclaim/oom.py) */
int tp_raw__oom__mark_victim(void *ctx) { return tp_raw_capture(ctx, MCP_TP_OOM_MARK_VICTIM); }
#endif /* MCP_PROBE_OOM_KILL */
