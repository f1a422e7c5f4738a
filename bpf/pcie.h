/* PCIe AER and link-change tracepoints (pcie.bpf.c, agent/pcie/records.py): raw copies, struct
 * mcp_ev_tp_raw of common.h, of these kinds. */
#ifndef MCP_PCIE_H
#define MCP_PCIE_H
#include "common.h"

enum mcp_tp_kind_pcie {
	MCP_TP_AER_EVENT = 2,         /* ras:aer_event */
	MCP_TP_PCIE_LINK_EVENT = 3,   /* pci:pcie_link_event */
};

#endif
