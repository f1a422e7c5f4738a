/* GPU and PCIe health tracepoints: nvidia:nvidia_dev_xid (the NVIDIA driver's Xid errors),
 * ras:aer_event (PCIe AER errors), pci:pcie_link_event (link speed/width changes).
 *
 * These are plain functions, not TRACEPOINT_PROBE: bcc generates a TRACEPOINT_PROBE's argument struct
 * from the format file at compile time, and these events come and go with a module (nvidia) or a
 * kernel config (CONFIG_PCIEAER, the PCIe port driver), and their layouts change between driver and
 * kernel versions (aer_event's tlp_header grew from 4 to 14 words for flit mode). So the kernel side
 * copies the record's first MCP_TP_RAW_LEN bytes and agent/gpuhealth/health_records.py decodes them with the format
 * it reads from tracefs at run time. agent/core/loader.py attaches each tp_raw__<group>__<event> with
 * attach_tracepoint(); a probe whose tracepoint is absent is not compiled (#if MCP_PROBE_<NAME>).
 *
 * ctx of a BPF_PROG_TYPE_TRACEPOINT program is the record itself, built in the per-CPU perf trace
 * buffer (perf_trace_buf_alloc(): PERF_MAX_TRACE_SIZE = 8192 bytes, the record at its start), so a
 * fixed-size read past the end of a shorter record stays inside that buffer; its __data_loc fields
 * tell user space where the record's own bytes end. The record's first 8 bytes (the common fields:
 * type, flags, preempt count, pid) are not there: perf_trace_run_bpf_submit() (kernel/events/core.c)
 * stores the pt_regs pointer over them before running the program (hence bcc's `u64
 * __do_not_use__`). They are zeroed here, so no kernel address reaches user space; the header's
 * tgid/tid say which task ran the tracepoint.
 */
#include "gpuhealth.h"

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

#if MCP_PROBE_GPU_XID
int tp_raw__nvidia__nvidia_dev_xid(void *ctx) { return tp_raw_capture(ctx, MCP_TP_NVIDIA_DEV_XID); }
#endif /* MCP_PROBE_GPU_XID */

#if MCP_PROBE_PCIE_AER
int tp_raw__ras__aer_event(void *ctx) { return tp_raw_capture(ctx, MCP_TP_AER_EVENT); }
#endif /* MCP_PROBE_PCIE_AER */

#if MCP_PROBE_PCIE_LINK_EVENT
int tp_raw__pci__pcie_link_event(void *ctx) { return tp_raw_capture(ctx, MCP_TP_PCIE_LINK_EVENT); }
#endif /* MCP_PROBE_PCIE_LINK_EVENT */

#if MCP_PROBE_OOM_KILL
/* its fields grew in 6.8 (total_vm, rss, uid, ...): copied and decoded at run time like the others */
int tp_raw__oom__mark_victim(void *ctx) { return tp_raw_capture(ctx, MCP_TP_OOM_MARK_VICTIM); }
#endif /* MCP_PROBE_OOM_KILL */

#if MCP_TEST_TP_RAW_EXEC
/* tests/gpuhealth/test_bpf_health.py only: the same capture on sched:sched_process_exec, which every kernel
 * has and which carries a __data_loc string (filename), to prove capture and run-time decoding on
 * hosts without the health tracepoints. */
int tp_raw__sched__sched_process_exec(void *ctx) { return tp_raw_capture(ctx, MCP_TP_TEST_EXEC); }
#endif /* MCP_TEST_TP_RAW_EXEC */
