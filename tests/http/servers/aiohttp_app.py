"""An unmodified aiohttp application (aiohttp only, no tracing) for the zero-code HTTP tests:

    python aiohttp_app.py PORT          (or $PORT)

Endpoints, shared by every server of tests/http/servers/:

  GET  /fast                       200, small fixed body with Content-Length
  GET  /slow?ms=N                  awaits N ms in the handler, then as /fast
  POST|PUT /echo                   reads the whole body (Content-Length or chunked); {"len": N}
  GET  /stream?events=N&gap_ms=M   chunked: N small events, written and drained one by one, M ms apart
  GET  /pid                        {"pid": os pid, "tid": the event loop thread's native id}
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading

from aiohttp import web


def _int(request: web.Request, name: str, default: int) -> int:
    try:
        return int(request.query.get(name, default))
    except ValueError:
        return default


async def fast(request: web.Request) -> web.Response:
    return web.Response(body=b"fast\n", content_type="text/plain")


async def slow(request: web.Request) -> web.Response:
    await asyncio.sleep(_int(request, "ms", 100) / 1000)
    return web.Response(body=b"slow\n", content_type="text/plain")


async def echo(request: web.Request) -> web.Response:
    body = await request.read()  # aiohttp decodes a chunked body
    return web.json_response({"len": len(body)})


async def stream(request: web.Request) -> web.StreamResponse:
    events, gap = _int(request, "events", 3), _int(request, "gap_ms", 10)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    for i in range(events):
        if i:
            await asyncio.sleep(gap / 1000)
        await resp.write(b"data: %d\n\n" % i)
    await resp.write_eof()
    return resp


async def pid(request: web.Request) -> web.Response:
    return web.json_response({"pid": os.getpid(), "tid": threading.get_native_id()})


def make_app() -> web.Application:
    app = web.Application()
    app.router.add_get("/fast", fast)
    app.router.add_get("/slow", slow)
    app.router.add_post("/echo", echo)
    app.router.add_put("/echo", echo)
    app.router.add_get("/stream", stream)
    app.router.add_get("/pid", pid)
    return app


if __name__ == "__main__":
    port = int(sys.argv[1] if len(sys.argv) > 1 else os.environ["PORT"])
    web.run_app(make_app(), host="127.0.0.1", port=port, access_log=None, print=None)
