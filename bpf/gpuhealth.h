/* GPU health tracepoints (gpuhealth.bpf.c, agent/gpuhealth/xid.py): raw copies, struct mcp_ev_tp_raw
 * of common.h, of this kind. */
#ifndef MCP_GPUHEALTH_H
#define MCP_GPUHEALTH_H
#include "common.h"

enum mcp_tp_kind_gpuhealth {
	MCP_TP_NVIDIA_DEV_XID = 1,    /* nvidia:nvidia_dev_xid */
};

#endif
