"""ASGI middleware marking each HTTP request for mcp-agent: one line in the application.

    app = MarkRequests(app)              # Starlette/FastAPI: app.add_middleware(MarkRequests)

A marker is per thread: the request is marked on the event loop's thread from the moment its
scope arrives until its response's last body message is sent. Requests interleaved on one loop
thread supersede each other's marks (the agent ends the earlier one as `superseded`); for servers
with many concurrent requests per loop, the agent's zero-code HTTP requests (docs/HTTP.md) need no
marker at all and keep them apart by connection.
"""

from __future__ import annotations

from . import end, begin, new_request_id


class MarkRequests:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        # Two traceparent fields are one "a, b" value (RFC 9110 5.3), which is no traceparent: the
        # agent then sees an invalid one, not the first of the two.
        traceparent = b", ".join(value for name, value in scope.get("headers") or () if name == b"traceparent") or None
        rid = new_request_id()
        begin(rid, traceparent)
        ended = False

        async def send_and_end(message):
            nonlocal ended
            await send(message)
            if message.get("type") == "http.response.body" and not message.get("more_body", False) and not ended:
                ended = True
                end(rid)

        try:
            await self.app(scope, receive, send_and_end)
        finally:
            if not ended:
                end(rid)
