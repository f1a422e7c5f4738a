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


# ---- OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]HEADERS ----------------------------------------------------
# The SDK parses these itself, and logs an entry it cannot parse whole, value included, at warning
# (opentelemetry.util.re): `Authorization:Bearer <token>` put the token in the agent's log. The
# agent checks them first, with the SDK's own grammar (liberal form: a value may hold spaces), and
# refuses to start on one the SDK would not take; its error names the header, never the value.
ENV_HEADER_VARS = ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
                   "OTEL_EXPORTER_OTLP_METRICS_HEADERS")
_ENV_KEY = r"[\x21\x23-\x27\x2a\x2b\x2d\x2e\x30-\x39\x41-\x5a\x5e-\x7a\x7c\x7e]+"
_ENV_VALUE = r"[\x20\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]*"
_ENV_KEY_RE = re.compile(_ENV_KEY + r"\Z")
_ENV_PAIR = re.compile(rf"[ \t]*{_ENV_KEY}[ \t]*=[ \t]*{_ENV_VALUE}[ \t]*\Z")
_ENV_DELIMITER = re.compile(r"[ \t]*,[ \t]*")


def check_env_headers(name: str, text: str) -> None:
    """ValueError(reason) unless every comma-separated entry of text is a header the SDK parses
    without a warning. The reason names the header (or its position), never a value."""
    for n, entry in enumerate(re.split(_ENV_DELIMITER, text), 1):
        if not entry or _ENV_PAIR.match(entry.strip()):
            continue
        entry = entry.strip()
        key, eq, _ = entry.partition("=")
        colon_key = entry.partition(":")[0].strip()
        if eq and _ENV_KEY_RE.match(key.strip()):
            raise ValueError(f"{name}: header {key.strip().lower()!r}: the value has characters OTLP headers "
                             "do not allow unencoded (\" , ; \\ or control characters: %-encode them); "
                             "the value is not shown")
        if not eq and ":" in entry and _ENV_KEY_RE.match(colon_key):
            raise ValueError(f"{name}: header {colon_key.lower()!r}: written name:value; OTLP headers are "
                             f"name=value (e.g. {colon_key.lower()}=...); the value is not shown")
        raise ValueError(f"{name}: entry {n} of the comma-separated list is not name=value; "
                         "its text is not shown")


def check_env(env) -> None:
    """check_env_headers for each OTEL_EXPORTER_OTLP_*HEADERS variable set in env."""
    for name in ENV_HEADER_VARS:
        if env.get(name):
            check_env_headers(name, env[name])
