/* The toy capability's one record (tests/core/test_toy_capability.py): a getppid() call made inside
 * a marked request. A number of its own, clear of the agent's families' (1-21). */
#ifndef MCP_TOY_H
#define MCP_TOY_H

#include "common.h"

enum mcp_toy_event_type { MCP_EV_TOY_GETPPID = 90 };

struct mcp_ev_toy {
	struct mcp_hdr h;      /* the calling thread */
	__u64 request_id;      /* its open request */
};

#endif
