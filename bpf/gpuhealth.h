/* GPU and PCIe health tracepoints (health.bpf.c, agent/gpuhealth/health_records.py).
 * bcc's TRACEPOINT_PROBE needs a tracepoint's format at compile time, and nvidia:nvidia_dev_xid
 * exists only while the driver is loaded (ras:aer_event, pci:pcie_link_event only on some kernels),
 * so the BPF side copies the record's first bytes and user space decodes them with the format it
 * reads from tracefs at run time. A BPF_PROG_TYPE_TRACEPOINT program's ctx is the record in the
 * per-CPU perf trace buffer (PERF_MAX_TRACE_SIZE, 8192 bytes; kernel/trace/trace_event_perf.c), so a
 * fixed-size read past a shorter record stays inside that buffer; bytes past the record are stale. */
#ifndef MCP_GPUHEALTH_H
#define MCP_GPUHEALTH_H
#include "common.h"

enum mcp_health_event_type {
	MCP_EV_TP_RAW = 6,        /* the first bytes of a GPU/PCIe health tracepoint record */
};
#define MCP_TP_RAW_LEN 512
#define MCP_TP_RAW_MIN 64         /* the fallback read when MCP_TP_RAW_LEN bytes cannot be read */

enum mcp_tp_kind {
	MCP_TP_NVIDIA_DEV_XID = 1,    /* nvidia:nvidia_dev_xid */
	MCP_TP_AER_EVENT = 2,         /* ras:aer_event */
	MCP_TP_PCIE_LINK_EVENT = 3,   /* pci:pcie_link_event */
	MCP_TP_OOM_MARK_VICTIM = 4,   /* oom:mark_victim (reclaim: OOM kills) */
	MCP_TP_TEST_EXEC = 15,        /* sched:sched_process_exec, compiled only for tests (MCP_TEST_TP_RAW_EXEC) */
};

struct mcp_ev_tp_raw {
	struct mcp_hdr h;         /* the task that ran the tracepoint (for an Xid, often the driver's irq thread) */
	__u32 kind;               /* enum mcp_tp_kind */
	__u32 len;                /* bytes of data read: MCP_TP_RAW_LEN, or MCP_TP_RAW_MIN after a failed read */
	__u8 data[MCP_TP_RAW_LEN];/* the tracepoint record, its 8-byte common header zeroed (the kernel
	                           * keeps a pt_regs pointer there for BPF); stale bytes past its end */
};

enum mcp_stat_gpuhealth {
	MCP_STAT_TP_READ_SHORT = 128,     /* health tracepoint: the MCP_TP_RAW_LEN read failed, MCP_TP_RAW_MIN kept */
	MCP_STAT_TP_READ_FAIL,            /* health tracepoint: no byte of the record readable, nothing sent */
};

#endif
