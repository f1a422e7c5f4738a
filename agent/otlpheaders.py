"""OTLP request headers (tokens) from a root-owned 0600 file: the export.headers_file setting.

A token on the command line is world-readable in /proc/PID/cmdline, and one in the environment
sits in /proc/PID/environ and in every child's environment. The file is read at start and on each
SIGHUP reload, and the headers go straight to the exporter constructors: never into os.environ,
argv, a log line or an error message (errors name the line, never its text).

Format: one `name=value` per line (OTEL_EXPORTER_OTLP_HEADERS syntax; several comma-separated pairs on
a line work too; values may be %-encoded), blank lines and `#` comments ignored:

    # /etc/mcp-hostagent/otlp-headers  (root:root, mode 0600)
    authorization=Bearer eyJhbGciOi...
"""

from __future__ import annotations

import os
import re
import stat
from urllib.parse import unquote

MAX_BYTES = 64 << 10
_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+\Z")  # an RFC 9110 token, lower case (gRPC metadata)


def check_file(path: str, st: os.stat_result | None = None) -> os.stat_result:
    """Raises ValueError unless path is a regular file owned by root with no group/other access."""
    st = os.stat(path) if st is None else st
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("not a regular file")
    if st.st_uid != 0:
        raise ValueError(f"must be owned by root (uid 0), is owned by uid {st.st_uid}; HINT: chown root:root")
    if st.st_mode & 0o077:
        raise ValueError(f"must not be readable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                         "HINT: chmod 0600")
    return st


def read_headers_file(path: str) -> dict[str, str]:
    """{lower-case name: value}. ValueError(reason) names the problem and line, never a value."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        raise ValueError("no such file") from None
    except OSError as e:
        raise ValueError(f"cannot open: {e.strerror or e}") from None
    try:
        check_file(path, os.fstat(fd))  # the file opened, not whatever the path names a moment later
        data = os.read(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        raise ValueError(f"larger than {MAX_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    return parse_headers(text)


def parse_headers(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        for pair in line.split(","):
            pair = pair.strip()
            if not pair:
                continue
            name, sep, value = pair.partition("=")
            name, value = unquote(name).strip().lower(), unquote(value).strip()
            if not sep or not _NAME.match(name):
                raise ValueError(f"line {n}: expected name=value with a header name of a-z 0-9 and -._~!#$&'*+^`|")
            if not value or any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
                raise ValueError(f"line {n}: header {name!r} has an empty value or control characters")
            out[name] = value
    if not out:
        raise ValueError("no headers in it")
    return out
