"""An HTTP/1.1 request head's first bytes -> method, path, version, traceparent. Pure.

The bytes come from any client of a watched server: nothing here trusts them. The query string is
dropped (credentials and ids travel there) and the path is cut, so that a span carries no more of a
URL than a route would.

As strict as a server: a head a conforming server must refuse, or may read otherwise than a lenient
parser would, gives no traceparent (the span must not join a trace on the strength of a head the
server answered 400, or read with other field boundaries). RequestHead.problem says why, the first
found, in the order of the captured lines:
  bare_lf                a line ended by LF alone (RFC 9112 2.2: the terminator is CRLF; a server
                         MAY take a bare LF, so whether it saw the same fields is unknown)
  bare_cr                a CR not followed by LF (RFC 9112 2.2: MUST be taken as invalid or as SP)
  obs_fold               a field line starting with SP or HTAB: obsolete line folding, or
                         whitespace before the first field (RFC 9112 5.2, 2.2)
  space_before_colon     whitespace between a field name and its colon (RFC 9112 5.1: MUST reject, 400)
  bad_field_name         an empty name, a character outside token (RFC 9110 5.1, 5.6.2), or no colon
  bad_field_value        a control character other than HTAB in a value (RFC 9110 5.5: reject or
                         replace with SP)
  duplicate_traceparent  two traceparent fields: a recipient may combine them into one "a, b"
                         value (RFC 9110 5.3), which is no traceparent (the W3C Trace Context test
                         suite's test_traceparent_duplicated expects a new trace)
The method, path and version stay when the request line itself is well formed: the server answered
something, and the span says what. Only the captured bytes are checked (a head longer than they are
may hold a problem, or a second traceparent, beyond them), and a line the capture cut in its middle
is not read at all: a traceparent cut after 55 characters would otherwise be a valid one that the
client never sent.

url.path: OTel's url.* conventions never carry credentials (url.full's userinfo is written
REDACTED) and scrub what an instrumentation can identify. Here:
  origin-form "/..."            the path, every segment holding an "@" written REDACTED (userinfo in
                                "//user:pw@host/x" -> "//REDACTED/x", an e-mail address in
                                "/users/a@b.example" -> "/users/REDACTED"), before the cut to MAX_PATH
                                so that a cut can never leave the part before an "@" standing alone
  absolute-form "scheme://..."  the path after the authority (userinfo included) or "/", scrubbed alike
  asterisk-form "*"             "*"
  anything else                 "" (authority-form "user:pw@host:443", or no target a server takes)
A path with anything but visible ASCII (a path is percent-encoded on the wire) is "" too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

METHODS = frozenset({"GET", "POST", "PUT", "HEAD", "DELETE", "PATCH", "OPTIONS"})
MAX_PATH = 128
REDACTED = "REDACTED"
PROBLEMS = ("bare_lf", "bare_cr", "obs_fold", "space_before_colon", "bad_field_name", "bad_field_value",
            "duplicate_traceparent")
_REQUEST_LINE = re.compile(rb"([A-Z]{3,7}) (\S{1,8192}) HTTP/(1\.[01])(\r?)\n")
_PATH_OK = re.compile(r"[\x21-\x7e]*")  # visible ASCII: a path is percent-encoded on the wire
_ABSOLUTE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")  # RFC 3986 3.1: a scheme, any case
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 5.6.2 tchar
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # CTL but HTAB (RFC 9110 5.5 field-value)


@dataclass(frozen=True)
class RequestHead:
    method: str  # one of METHODS, else "_OTHER" (OTel's http.request.method rule)
    path: str  # without query or fragment, scrubbed, at most MAX_PATH characters; "" if unreadable
    version: str  # "1.1" or "1.0"
    traceparent: bytes | None  # the header's raw value; None if absent from the captured bytes, or problem
    complete: bool  # the head's empty line was within the captured bytes
    problem: str | None = None  # one of PROBLEMS: a head a strict server refuses (module docstring)


def _scrub(path: str) -> str:
    if "@" not in path:
        return path
    return "/".join(REDACTED if "@" in seg else seg for seg in path.split("/"))


def _path(target: str) -> str:
    path = target.split("?", 1)[0].split("#", 1)[0]
    if m := _ABSOLUTE.match(path):  # absolute-form (a proxy's): keep the path only
        _, slash, rest = path[m.end():].partition("/")
        path = "/" + rest if slash else "/"
    elif path == "*":
        return path
    elif not path.startswith("/"):
        return ""
    if not _PATH_OK.fullmatch(path):
        return ""
    return _scrub(path)[:MAX_PATH]


def _fields(raw: bytes, pos: int, problem: str | None) -> tuple[bytes | None, str | None, bool]:
    """(traceparent, problem, complete) of the field lines from pos to the empty line."""
    traceparent = None
    seen = False
    while (nl := raw.find(b"\n", pos)) >= 0:  # a last line without its LF was cut: not read
        crlf = nl > pos and raw[nl - 1] == 0x0D
        line = raw[pos:nl - 1] if crlf else raw[pos:nl]
        pos = nl + 1
        found = None if crlf else "bare_lf"
        if not line:
            problem = problem or found
            return (None if problem else traceparent), problem, True
        name, sep, value = line.partition(b":")
        if b"\r" in line:
            found = found or "bare_cr"
        elif line[0] in b" \t":
            found = found or "obs_fold"
        elif not sep:
            found = found or "bad_field_name"
        elif name != name.rstrip(b" \t") and _TOKEN.fullmatch(name.rstrip(b" \t")):
            found = found or "space_before_colon"
        elif not _TOKEN.fullmatch(name):
            found = found or "bad_field_name"
        elif _BAD_VALUE.search(value):
            found = found or "bad_field_value"
        elif name.lower() == b"traceparent":
            if seen:
                found = found or "duplicate_traceparent"
            seen = True
            traceparent = value.strip(b" \t")  # OWS (RFC 9110 5.5)
        problem = problem or found
    return (None if problem else traceparent), problem, False


def parse(raw: bytes) -> RequestHead | None:
    """None when the bytes do not start with an HTTP/1.x request line."""
    m = _REQUEST_LINE.match(raw)
    if not m:
        return None
    method = m.group(1).decode()
    traceparent, problem, complete = _fields(raw, m.end(), None if m.group(4) else "bare_lf")
    return RequestHead(method if method in METHODS else "_OTHER", _path(m.group(2).decode("latin-1")),
                       m.group(3).decode(), traceparent, complete, problem)
