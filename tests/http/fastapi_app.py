"""An unmodified FastAPI application served by uvicorn (both from PyPI): no marker, no OTel. The
zero-code HTTP tests run it in a process of its own and check the agent's spans against what each
endpoint did, measured from /proc by the endpoint itself and returned in its response.

  GET  /touch?pages=N     touches N new pages on the event loop thread (N minor faults)
  GET  /handoff?pages=N   the same in the thread pool (a sync endpoint: FastAPI's hand-off)
  POST /engine?pages=N    hands the work to a worker process over a pipe and waits for it
  GET  /stream?events=N&gap_ms=M   Server-Sent Events: N events, M ms apart, chunked
  GET  /status/{code}     an empty response with that status
"""

from __future__ import annotations

import asyncio
import mmap
import multiprocessing as mp
import os
import threading

from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse

PAGE = os.sysconf("SC_PAGE_SIZE")
app = FastAPI()
_engine = None
_engine_lock = threading.Lock()


def minflt(tid: int | None = None) -> int:
    """This thread's (or the process's) minor faults: field 10 of /proc/.../stat."""
    path = f"/proc/self/task/{tid}/stat" if tid else "/proc/self/stat"
    with open(path) as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def touch(pages: int) -> dict:
    tid = threading.get_native_id()
    before = minflt(tid)
    m = mmap.mmap(-1, pages * PAGE)
    for i in range(pages):
        m[i * PAGE] = 1
    after = minflt(tid)
    m.close()
    return {"tid": tid, "faults": after - before}


def _engine_main(conn) -> None:
    while True:
        pages = conn.recv()
        if pages is None:
            return
        r = touch(pages)
        conn.send({**r, "pid": os.getpid()})


def engine():
    global _engine
    with _engine_lock:
        if _engine is None:
            parent, child = mp.Pipe()
            p = mp.get_context("fork").Process(target=_engine_main, args=(child,), daemon=True)
            p.start()
            _engine = (parent, p)
        return _engine


@app.get("/touch")
async def touch_loop(pages: int = 100):
    return touch(pages)


@app.get("/handoff")
def touch_pool(pages: int = 100):  # a sync endpoint: runs in the thread pool, not on the event loop
    return touch(pages)


@app.get("/engine/pid")
def engine_pid():
    return {"pid": engine()[1].pid}


@app.post("/engine")
def touch_engine(pages: int = 100):
    conn, _ = engine()
    with _engine_lock:
        conn.send(pages)
        return conn.recv()


@app.get("/stream")
async def stream(events: int = 5, gap_ms: int = 50):
    async def gen():
        for i in range(events):
            await asyncio.sleep(gap_ms / 1000)
            yield f"data: {i}\n\n"
    return StreamingResponse(gen(), media_type="text/event-stream")


@app.get("/status/{code}")
async def status(code: int):
    return Response(status_code=code)
