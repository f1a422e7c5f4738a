"""Python-side loops for bench_marker.py, in a child process (so they never wait for the agent's GIL).

Reads one command per line on stdin, answers one line of numbers (ns per call, one per batch):
    pairs BATCH NBATCH PAUSE_S    mcp_hostagent.marker.begin + end
    getppid BATCH NBATCH          os.getppid()
"""

import os
import sys
import time

from mcp_hostagent import marker


def pairs(batch: int, nbatch: int, pause_s: float) -> list[float]:
    begin, end = marker.begin, marker.end
    rid = marker.new_request_id() & ~((1 << 32) - 1)
    out = []
    for _ in range(nbatch):
        t0 = time.perf_counter_ns()
        for i in range(batch):
            begin(rid + i)
            end(rid + i)
        out.append((time.perf_counter_ns() - t0) / batch)
        rid += batch
        time.sleep(pause_s)
    return out


def getppid(batch: int, nbatch: int) -> list[float]:
    f = os.getppid
    out = []
    for _ in range(nbatch):
        t0 = time.perf_counter_ns()
        for _ in range(batch):
            f()
        out.append((time.perf_counter_ns() - t0) / batch)
    return out


for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "pairs":
        res = pairs(int(args[0]), int(args[1]), float(args[2]))
    elif cmd == "getppid":
        res = getppid(int(args[0]), int(args[1]))
    else:
        sys.exit(f"unknown command {cmd!r}")
    print(" ".join(f"{x:.1f}" for x in res), flush=True)
