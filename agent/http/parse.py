"""An HTTP/1.1 request head's first bytes -> method, path, version, traceparent. Pure.

The bytes come from any client of a watched server: nothing here trusts them. The query string is
dropped (credentials and ids travel there) and the path is cut, so that a span carries no more of a
URL than a route would.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

METHODS = frozenset({"GET", "POST", "PUT", "HEAD", "DELETE", "PATCH", "OPTIONS"})
MAX_PATH = 128
_REQUEST_LINE = re.compile(rb"([A-Z]{3,7}) (\S{1,8192}) HTTP/(1\.[01])\r?\n")
_PATH_OK = re.compile(r"[\x21-\x7e]*")  # visible ASCII: a path is percent-encoded on the wire


@dataclass(frozen=True)
class RequestHead:
    method: str  # one of METHODS, else "_OTHER" (OTel's http.request.method rule)
    path: str  # without query or fragment, at most MAX_PATH characters; "" if unreadable
    version: str  # "1.1" or "1.0"
    traceparent: bytes | None  # the header's raw value; None if absent from the captured bytes
    complete: bool  # the head's empty line was within the captured bytes


def parse(raw: bytes) -> RequestHead | None:
    """None when the bytes do not start with an HTTP/1.x request line."""
    m = _REQUEST_LINE.match(raw)
    if not m:
        return None
    method = m.group(1).decode()
    target = m.group(2).decode("latin-1")
    path = target.split("?", 1)[0].split("#", 1)[0]
    if target.startswith(("http://", "https://")):  # absolute-form (a proxy's): keep the path only
        path = "/" + path.split("/", 3)[3] if path.count("/") >= 3 else "/"
    if not _PATH_OK.fullmatch(path):
        path = ""
    traceparent = None
    for line in raw[m.end():].split(b"\n"):
        line = line.rstrip(b"\r")
        if not line:
            break
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"traceparent":
            traceparent = value.strip()
            break
    return RequestHead(method if method in METHODS else "_OTHER", path[:MAX_PATH], m.group(3).decode(),
                       traceparent, b"\r\n\r\n" in raw or b"\n\n" in raw)
