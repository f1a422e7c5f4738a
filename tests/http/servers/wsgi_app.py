"""An unmodified WSGI application (standard library only, no tracing) for the zero-code HTTP tests,
served by gunicorn, e.g.

    python -m gunicorn --bind 127.0.0.1:PORT --worker-class sync --workers 2 wsgi_app:app
    python -m gunicorn --bind 127.0.0.1:PORT --worker-class gthread --threads 4 --workers 2 \
        --max-requests 5 --max-requests-jitter 0 wsgi_app:app

(tests/http/realservers.py builds these command lines; gunicorn takes the port, workers, threads and
max-requests from its argv). Endpoints, shared by every server of tests/http/servers/:

  GET  /fast                       200, small fixed body with Content-Length
  GET  /slow?ms=N                  sleeps N ms in the handler, then as /fast
  POST|PUT /echo                   reads the whole body (Content-Length or chunked); {"len": N}
  GET  /stream?events=N&gap_ms=M   N small events yielded one by one, M ms apart (no Content-Length:
                                   gunicorn answers an HTTP/1.1 request chunked)
  GET  /pid                        {"pid": the worker's pid, "tid": the serving thread's native id}
"""

from __future__ import annotations

import json
import os
import threading
import time
from urllib.parse import parse_qs


def _int(query: dict, name: str, default: int) -> int:
    try:
        return int(query[name][0])
    except (KeyError, ValueError, IndexError):
        return default


def _fixed(start_response, status: str, ctype: str, body: bytes):
    start_response(status, [("Content-Type", ctype), ("Content-Length", str(len(body)))])
    return [body]


def app(environ, start_response):
    path, method = environ.get("PATH_INFO", ""), environ["REQUEST_METHOD"]
    query = parse_qs(environ.get("QUERY_STRING", ""))
    if path == "/fast":
        return _fixed(start_response, "200 OK", "text/plain", b"fast\n")
    if path == "/slow":
        time.sleep(_int(query, "ms", 100) / 1000)
        return _fixed(start_response, "200 OK", "text/plain", b"slow\n")
    if path == "/echo":
        if method not in ("POST", "PUT"):
            return _fixed(start_response, "405 Method Not Allowed", "text/plain", b"method not allowed\n")
        n, inp = 0, environ["wsgi.input"]  # gunicorn decodes a chunked body here
        while True:
            data = inp.read(65536)
            if not data:
                break
            n += len(data)
        return _fixed(start_response, "200 OK", "application/json", json.dumps({"len": n}).encode())
    if path == "/stream":
        events, gap = _int(query, "events", 3), _int(query, "gap_ms", 10)
        start_response("200 OK", [("Content-Type", "text/event-stream")])

        def gen():
            for i in range(events):
                if i:
                    time.sleep(gap / 1000)
                yield b"data: %d\n\n" % i  # gunicorn writes (and sends) each item as one chunk

        return gen()
    if path == "/pid":
        body = json.dumps({"pid": os.getpid(), "tid": threading.get_native_id()}).encode()
        return _fixed(start_response, "200 OK", "application/json", body)
    return _fixed(start_response, "404 Not Found", "text/plain", b"not found\n")
