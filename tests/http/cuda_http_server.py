"""An HTTP server that launches kernels on the stand-in libcuda (tests/c/fake_libcuda.c) in the thread
that serves each request: GET /launch?n=N&gap_us=G -> N cuLaunchKernel calls, G us apart; the body
says the library's own call count after them and the serving thread. GET /calls -> the count.
A background thread can keep a steady launch rate (argv[3], per second) so the governor duty-cycles.
Stdlib only (http.server, one thread per connection); argv: libcuda path, port [, background rate [, an NVIDIA device file to hold open]]."""

import ctypes
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

lib = ctypes.CDLL(sys.argv[1])
calls = (ctypes.c_ulong * 22).in_dll(lib, "fake_calls")
ARGS = [None, 0, 0, 0, 0, 0, 0, 0, None, None, None]
lock = threading.Lock()


def launch(n: int, gap_s: float = 0.0) -> None:
    for _ in range(n):
        lib.cuLaunchKernel(*ARGS)
        if gap_s:
            time.sleep(gap_s)


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_GET(self):
        u = urlparse(self.path)
        q = {k: int(v[0]) for k, v in parse_qs(u.query).items()}
        if u.path == "/launch":
            launch(q.get("n", 0), q.get("gap_us", 0) / 1e6)
        body = json.dumps({"calls": calls[0], "tid": threading.get_native_id()}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


if __name__ == "__main__":
    if len(sys.argv) > 4:  # a (stand-in) NVIDIA device file held open: the governor steers by such users
        dev = open(sys.argv[4], "a+b")
    if len(sys.argv) > 3 and int(sys.argv[3]):
        rate = int(sys.argv[3])

        def steady():
            while True:
                launch(rate // 100)
                time.sleep(0.01)
        threading.Thread(target=steady, daemon=True).start()
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), H).serve_forever()
