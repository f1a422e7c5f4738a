"""What a hostile unprivileged user runs against the zero-code HTTP path (tests/system/test_security_http.py).
Standard library only: it runs under the system python3 as uid 4242, from a directory that uid can read.

    hostile_http.py spoof-socketpairs N [PER_S]   map plain files named dev/nvidia0 and libcuda.so.1 (a GPU
                                          process by path text), then read a whole request head on each of
                                          N socketpairs and never answer: N connections in flight
    hostile_http.py slowloris PORT N      N connections to PORT, each with a head that never ends,
                                          a byte more every few seconds
    hostile_http.py flood                 request/response pairs over socketpairs, as fast as it can
Each prints "ready" once set up (flood: at once), then holds until killed.
"""

from __future__ import annotations

import mmap
import os
import resource
import socket
import sys
import time

HEAD = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


def more_fds(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, n)), hard))


def spoof_socketpairs(n: int, per_s: float = 0) -> None:
    keep = []
    os.makedirs("dev", exist_ok=True)
    for name in ("dev/nvidia0", "libcuda.so.1"):  # plain files: no NVIDIA device, no trusted driver
        with open(name, "wb") as f:
            f.write(b"\0" * 4096)
        fd = os.open(name, os.O_RDWR)
        keep.append(mmap.mmap(fd, 4096))
    more_fds(2 * n + 64)
    pairs = []
    for _ in range(n):
        try:
            a, b = socket.socketpair()
        except OSError:
            break
        a.sendall(HEAD)
        b.recv(4096)  # the "server" side reads a whole head and never answers
        pairs.append((a, b))
        if per_s:
            time.sleep(1 / per_s)
    print("ready", len(pairs), flush=True)
    time.sleep(3600)


def slowloris(port: int, n: int) -> None:
    more_fds(n + 64)
    conns = []
    for _ in range(n):
        try:
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\nX-a: ")
            conns.append(s)
        except OSError:
            break
    print("ready", len(conns), flush=True)
    while True:
        time.sleep(3)
        for s in conns:
            try:
                s.send(b"a")
            except OSError:
                pass


def flood() -> None:
    print("ready", flush=True)
    resp = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    while True:
        a, b = socket.socketpair()
        for _ in range(100):
            a.sendall(HEAD)
            b.recv(4096)
            b.sendall(resp)
            a.recv(4096)
        a.close()
        b.close()


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "spoof-socketpairs":
        spoof_socketpairs(int(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 0)
    elif mode == "slowloris":
        slowloris(int(sys.argv[2]), int(sys.argv[3]))
    elif mode == "flood":
        flood()
    else:
        sys.exit(f"unknown mode {mode}")
