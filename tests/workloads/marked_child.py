"""A serving-process stand-in driven step by step over stdin/stdout, so the parent can read this
process's /proc counters while it is blocked between steps (no faults or switches of its own then).

Commands, one per line: `begin RID TRACEPARENT`, `end RID`, `touch N` (N first-touch page faults),
`sleep K MS` (K voluntary switches), `spin MS` (busy loop), `busy RID MS` (a request that only spins:
no switch of its own between its begin and end), `read PATH` (through the page cache), `mapread PATH`
(map it and touch each page), `thread_exit RID` (a thread begins a
request and exits inside it), `raw MAGIC VERSION OP` (a hand-made marker), `badptr`, `exit [MS]`
(spin MS, then exit without an answer). Other commands answer `ok` when done."""

import ctypes
import mmap
import sys
import threading
import time

from mcp_hostagent import marker
from mcp_hostagent.requests.records import C, Mark

PAGE = mmap.PAGESIZE
libc = ctypes.CDLL(None, use_errno=True)
libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
keep = []


def touch(n: int) -> None:
    buf = mmap.mmap(-1, n * PAGE)
    buf.madvise(mmap.MADV_NOHUGEPAGE)  # one fault per 4 KiB page, not one per 2 MiB
    for i in range(n):
        buf[i * PAGE] = 1
    keep.append(buf)


def spin(ms: int) -> None:
    t = time.monotonic() + ms / 1000
    while time.monotonic() < t:
        pass


def main() -> None:
    # warm every code path used between handshakes so they fault nothing later
    touch(1)
    marker.end(0)
    time.sleep(0)
    out = sys.stdout
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "begin":
            marker.begin(int(args[0]), args[1] if len(args) > 1 else None)
        elif cmd == "end":
            marker.end(int(args[0]))
        elif cmd == "touch":
            touch(int(args[0]))
        elif cmd == "sleep":
            for _ in range(int(args[0])):
                time.sleep(int(args[1]) / 1000)
        elif cmd == "spin":
            spin(int(args[0]))
        elif cmd == "busy":
            marker.begin(int(args[0]))
            spin(int(args[1]))
            marker.end(int(args[0]))
        elif cmd == "thread_exit":
            t = threading.Thread(target=marker.begin, args=(int(args[0]), None))
            t.start()
            t.join()
        elif cmd == "raw":
            m = Mark(int(args[0], 0), int(args[1]), int(args[2]), 7, b"")
            libc.ioctl(-1, C["MCP_MARK_CMD"], ctypes.addressof(m))
        elif cmd == "read":  # read a file through the page cache, 1 MiB at a time
            with open(args[0], "rb", buffering=0) as f:
                while f.read(1 << 20):
                    pass
        elif cmd == "mapread":  # map a file and touch each page: file faults, as a safetensors load
            with open(args[0], "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
                sum(m[i] for i in range(0, len(m), PAGE))
        elif cmd == "write":  # write N MiB to a file: dirty page cache that reclaim must wait on
            chunk = b"x" * (1 << 20)
            with open(args[0], "wb", buffering=0) as f:
                for _ in range(int(args[1])):
                    f.write(chunk)
        elif cmd == "badptr":
            libc.ioctl(-1, C["MCP_MARK_CMD"], 0x10)
        elif cmd == "exit":
            spin(int(args[0]) if args else 0)
            return
        out.write("ok\n")
        out.flush()


if __name__ == "__main__":
    main()
