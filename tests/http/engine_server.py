"""vLLM's shape with the standard library: a front end (http.server) that forks its engine process at
start, before any request, and hands each request's work to it over a pipe. POST /work?pages=N: the
engine first-touches N pages and answers with its pid and the faults it made (its /proc/self/stat).
argv: port."""

import json
import mmap
import os
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from urllib.parse import parse_qs, urlparse


def faults() -> int:
    with open("/proc/self/stat") as f:
        x = f.read().rsplit(")", 1)[1].split()
    return int(x[7]) + int(x[9])


def engine(rd: int, wr: int) -> None:
    while True:
        line = os.read(rd, 64)
        if not line:
            os._exit(0)
        pages = int(line)
        f0 = faults()
        m = mmap.mmap(-1, pages * 4096)
        for i in range(pages):
            m[i * 4096] = 1
        m.close()
        os.write(wr, json.dumps({"pid": os.getpid(), "faults": faults() - f0}).encode())


to_engine_r, to_engine_w = os.pipe()
from_engine_r, from_engine_w = os.pipe()
if os.fork() == 0:
    engine(to_engine_r, from_engine_w)


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_POST(self):
        u = urlparse(self.path)
        n = int(parse_qs(u.query).get("pages", ["1"])[0])
        os.write(to_engine_w, str(n).encode())
        body = os.read(from_engine_r, 4096)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
