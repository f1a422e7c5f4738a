/* The toy capability: one tracepoint, one record, sent only for a thread with an open request
 * (req_by_tid, common.bpf.c), as a real capability filters in the kernel. The record joins that
 * request, so it goes in req_events (rb_reserve(1, ...)), the ring its END travels in: in order
 * before it. In `events` it could be read after the END (epoll hands the rings over in any order)
 * and miss the span. */
#include "toy.h"

#if MCP_PROBE_TOY_GETPPID
TRACEPOINT_PROBE(syscalls, sys_enter_getppid)
{
	u64 pid_tgid = bpf_get_current_pid_tgid();
	u32 tid = (u32)pid_tgid;
	struct mcp_req_state *st = req_by_tid.lookup(&tid);
	if (!st)
		return 0;
	struct mcp_ev_toy *e = rb_reserve(1, sizeof(*e));
	if (!e)
		return 0;
	fill_hdr(&e->h, MCP_EV_TOY_GETPPID, sizeof(*e), pid_tgid, bpf_ktime_get_ns());
	e->request_id = st->request_id;
	req_events.ringbuf_submit(e, 0);
	return 0;
}
#endif
