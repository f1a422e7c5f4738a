/* Every record the BPF programs share with user space, for C code outside the agent (a serving
 * process's marker, the tests' drivers: docs/MARKER.md): each family's header, in the unit's order. */
#ifndef MCP_RECORDS_H
#define MCP_RECORDS_H
#include "common.h"
#include "requests.h"
#include "reclaim.h"
#include "cuda.h"
#include "gpuhealth.h"
#include "pcie.h"
#include "http.h"
#endif
