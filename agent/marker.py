"""Request marker for serving processes: tell the agent "this thread now serves request X".

The marker itself is the dependency-free package mcp_hostagent_marker (packaging/marker, installable
alone as mcp-hostagent-marker so that a serving process needs neither OTel nor grpc nor pyroute2);
this module keeps `from mcp_hostagent.marker import request` working where the agent is installed.
Wire format: docs/MARKER.md.

    from mcp_hostagent.marker import request
    with request(traceparent=headers.get("traceparent")):
        handle(...)
"""

from mcp_hostagent_marker import MARK_CMD, begin, end, new_request_id, request

__all__ = ["MARK_CMD", "begin", "end", "new_request_id", "request"]
