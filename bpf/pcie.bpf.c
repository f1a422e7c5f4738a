/* PCIe: ras:aer_event (AER errors as they are reported) and pci:pcie_link_event (link speed/width
 * changes), copied raw (tp_raw_capture, common.bpf.c: both depend on the kernel's config and version,
 * and their layouts change between versions) and decoded by agent/pcie/records.py with the format
 * tracefs gives at run time. */
#include "pcie.h"

#if MCP_PROBE_PCIE_AER
int tp_raw__ras__aer_event(void *ctx) { return tp_raw_capture(ctx, MCP_TP_AER_EVENT); }
#endif /* MCP_PROBE_PCIE_AER */

#if MCP_PROBE_PCIE_LINK_EVENT
int tp_raw__pci__pcie_link_event(void *ctx) { return tp_raw_capture(ctx, MCP_TP_PCIE_LINK_EVENT); }
#endif /* MCP_PROBE_PCIE_LINK_EVENT */
