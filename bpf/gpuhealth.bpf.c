/* GPU health: nvidia:nvidia_dev_xid, the NVIDIA driver's Xid errors, copied raw (tp_raw_capture,
 * common.bpf.c: the event exists only while the driver module is loaded, its layout is the driver's)
 * and decoded by agent/gpuhealth/xid.py with the format tracefs gives at run time. */
#include "gpuhealth.h"

#if MCP_PROBE_GPU_XID
int tp_raw__nvidia__nvidia_dev_xid(void *ctx) { return tp_raw_capture(ctx, MCP_TP_NVIDIA_DEV_XID); }
#endif /* MCP_PROBE_GPU_XID */
