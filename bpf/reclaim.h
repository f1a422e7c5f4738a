/* Reclaim stalls and kswapd (reclaim.bpf.c, agent/reclaim). */
#ifndef MCP_RECLAIM_H
#define MCP_RECLAIM_H

#include "common.h"

enum mcp_reclaim_event_type {
	MCP_EV_RECLAIM_STALL = 4, /* one direct or memcg reclaim stall over the threshold */
	MCP_EV_KSWAPD = 5,        /* kswapd woke or went to sleep on a node */
};

enum mcp_tp_kind_reclaim {
	MCP_TP_OOM_MARK_VICTIM = 4,   /* oom:mark_victim, copied raw (struct mcp_ev_tp_raw): OOM kills */
};

enum mcp_reclaim_kind {
	MCP_RECLAIM_DIRECT = 0,
	MCP_RECLAIM_MEMCG = 1,
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

enum mcp_stat_reclaim {
	MCP_STAT_RECLAIM_NO_BEGIN = 64,   /* reclaim end on a thread with no recorded begin */
};

#endif
