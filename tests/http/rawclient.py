"""A raw-socket HTTP/1.1 client for byte-level scenarios (split heads, pipelining, 100-continue,
chunked bodies, keep-alive), reporting exactly what the server wrote back. No pytest needed.

Every scenario returns a Responses list (a list of Response, in the order the server sent them):
interim 1xx responses are entries of their own (interim=True), before the final response they precede.
Each Response has status, reason, version, headers (a dict, lowercase names, last wins), header_list
(as sent), body (decoded: chunk framing removed), body_len (len(body)), raw_len (the exact number of
bytes of this response on the wire: status line, headers, blank line, body framing and trailers),
chunked, and t_first_ns / t_last_ns (time.monotonic_ns when its first / last byte was received).
The list also tells how the connection ended: .closed (the server closed it), .error (a timeout or a
socket error, else None), .leftover (bytes received after the last whole response), .t_sent_ns (when
the last request byte was written), .received (every byte received: the sum of raw_len plus
len(leftover)).

All connections set TCP_NODELAY, so separate writes leave as separate segments.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

TIMEOUT = 5.0


@dataclass
class Response:
    status: int
    reason: str
    version: str
    header_list: list
    body: bytes
    raw_len: int
    chunked: bool = False
    interim: bool = False
    t_first_ns: int = 0
    t_last_ns: int = 0
    headers: dict = field(default_factory=dict)
    framed_body_len: int = 0  # bytes after the head (chunk framing and trailers included)

    @property
    def body_len(self) -> int:
        return len(self.body)

    @property
    def head_len(self) -> int:
        """Status line, headers and the blank line."""
        return self.raw_len - self.framed_body_len

    def __repr__(self):
        kind = "interim " if self.interim else ""
        return (f"<{kind}Response {self.status} {self.reason!r} body_len={self.body_len} raw_len={self.raw_len}"
                f"{' chunked' if self.chunked else ''}>")


class Responses(list):
    closed: bool = False
    error: str | None = None
    leftover: bytes = b""
    received: int = 0  # every byte received on the connection (= sum of raw_len + len(leftover))
    t_sent_ns: int = 0
    continue_: str | None = None  # expect_continue(): "100", "timeout" or "final"

    @property
    def final(self) -> list:
        """The final (non-1xx) responses."""
        return [r for r in self if not r.interim]

    @property
    def interim(self) -> list:
        return [r for r in self if r.interim]

    def __repr__(self):
        extra = "".join([" closed" if self.closed else "", f" error={self.error!r}" if self.error else "",
                         f" leftover={len(self.leftover)}B" if self.leftover else ""])
        return f"Responses({list.__repr__(self)}{extra})"


class ConnectionEnded(Exception):
    """The server closed the connection (or it failed) before a whole response arrived."""


class Reader:
    """Buffered reads from a socket, remembering when each byte arrived."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()
        self.start = 0  # absolute offset of buf[0]
        self.arrivals: list[tuple[int, int]] = []  # (absolute end offset, monotonic_ns) per recv
        self.eof = False

    @property
    def pos(self) -> int:
        return self.start

    def _fill(self) -> None:
        if self.eof:
            raise ConnectionEnded("closed")
        data = self.sock.recv(65536)
        now = time.monotonic_ns()
        if not data:
            self.eof = True
            raise ConnectionEnded("closed")
        self.buf += data
        self.arrivals.append((self.start + len(self.buf), now))

    def arrival(self, pos: int) -> int:
        for end, ts in self.arrivals:
            if end > pos:
                return ts
        return 0

    def first_byte(self) -> int:
        """Waits for one byte to be available; returns its arrival time."""
        while not self.buf:
            self._fill()
        return self.arrival(self.start)

    def take(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        self.start += n
        return out

    def until(self, sep: bytes, limit: int = 1 << 20) -> bytes:
        """Bytes up to and including sep."""
        scan = 0
        while True:
            i = self.buf.find(sep, scan)
            if i >= 0:
                return self.take(i + len(sep))
            if len(self.buf) > limit:
                raise ValueError(f"no {sep!r} within {limit} bytes")
            scan = max(0, len(self.buf) - len(sep) + 1)
            self._fill()

    def rest(self) -> bytes:
        """Everything until the server closes."""
        try:
            while True:
                self._fill()
        except ConnectionEnded:
            pass
        return self.take(len(self.buf))

    def pending(self) -> bytes:
        return bytes(self.buf)


def parse_head(head: bytes) -> tuple[str, int, str, list]:
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code, _, reason = rest.partition(" ")
    if not version.startswith("HTTP/") or not code.isdigit():
        raise ValueError(f"bad status line {lines[0]!r}")
    hdrs = []
    for line in lines[1:]:
        if not line:
            continue
        name, _, value = line.partition(":")
        hdrs.append((name.strip(), value.strip()))
    return version, int(code), reason, hdrs


def read_response(rd: Reader, method: str = "GET") -> Response:
    """One response (interim or final) from rd."""
    t_first = rd.first_byte()
    start = rd.pos
    head = rd.until(b"\r\n\r\n")
    version, status, reason, hdrs = parse_head(head)
    headers = {k.lower(): v for k, v in hdrs}
    r = Response(status=status, reason=reason, version=version, header_list=hdrs, headers=headers, body=b"",
                 raw_len=0, t_first_ns=t_first)
    if 100 <= status < 200 and status != 101:
        r.interim = True
    elif method == "HEAD" or status in (101, 204, 304) or (method == "CONNECT" and 200 <= status < 300):
        pass
    elif "chunked" in headers.get("transfer-encoding", "").lower():
        r.chunked = True
        body = bytearray()
        while True:
            line = rd.until(b"\r\n")
            size = int(line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while rd.until(b"\r\n") != b"\r\n":  # trailers, then the blank line
                    pass
                break
            body += rd.take(size)
            if rd.take(2) != b"\r\n":
                raise ValueError("chunk not followed by CRLF")
        r.body = bytes(body)
    elif "content-length" in headers:
        r.body = rd.take(int(headers["content-length"]))
    else:
        r.body = rd.rest()  # close-delimited
    r.raw_len = rd.pos - start
    r.framed_body_len = r.raw_len - len(head)
    r.t_last_ns = rd.arrival(rd.pos - 1)
    return r


def request_method(req: bytes) -> str:
    return req.split(b" ", 1)[0].decode("latin-1", errors="replace")


def build_request(method: str, path: str, headers: dict | None = None, body: bytes | list | None = None,
                  chunked: bool = False, host: str = "127.0.0.1", version: str = "HTTP/1.1") -> bytes:
    """An HTTP/1.1 request: Host first (unless headers has one), then headers in their order, then
    Content-Length (a body, not chunked, and none given) or Transfer-Encoding: chunked. With chunked,
    body may be a list of chunks (bytes: one chunk; None or b"": none), followed by the last chunk."""
    headers = dict(headers or {})
    lines = [f"{method} {path} {version}"]
    names = {k.lower() for k in headers}
    if "host" not in names:
        lines.append(f"Host: {host}")
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if chunked:
        if "transfer-encoding" not in names:
            lines.append("Transfer-Encoding: chunked")
        chunks = body if isinstance(body, list) else ([body] if body else [])
        payload = encode_chunks(chunks)
    else:
        payload = body or b""
        if body is not None and "content-length" not in names:
            lines.append(f"Content-Length: {len(payload)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload


def encode_chunks(chunks: list) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks if c) + b"0\r\n\r\n"


def connect(port: int, timeout: float = TIMEOUT, host: str = "127.0.0.1") -> socket.socket:
    s = socket.create_connection((host, port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _read(rd: Reader, out: Responses, methods: list[str]) -> Responses:
    """Reads one final response per method (and any interim ones before each) into out."""
    try:
        for m in methods:
            while True:
                r = read_response(rd, m)
                out.append(r)
                if not r.interim:
                    break
    except ConnectionEnded:
        out.closed = True
    except (socket.timeout, TimeoutError):
        out.error = "timeout"
    except OSError as e:
        out.error = f"{type(e).__name__}: {e}"
    out.leftover = rd.pending()
    out.received = rd.pos + len(rd.buf)
    if not out.closed and not rd.buf and out.error is None:
        out.closed = _closed_now(rd.sock)
    return out


def _closed_now(sock: socket.socket) -> bool:
    """Whether the peer has already closed (EOF waiting), without blocking."""
    try:
        sock.setblocking(False)
        try:
            return sock.recv(1, socket.MSG_PEEK) == b""
        finally:
            sock.setblocking(True)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


def _send(sock: socket.socket, data: bytes, out: Responses) -> bool:
    try:
        sock.sendall(data)
        out.t_sent_ns = time.monotonic_ns()
        return True
    except OSError as e:
        out.error = f"send: {type(e).__name__}: {e}"
        return False


# ---------------------------------------------------------------- scenarios
def send_split(port: int, request_bytes: bytes, split_at, gap_s: float = 0.02, expect: int | None = None,
               timeout: float = TIMEOUT) -> Responses:
    """One connection: writes request_bytes[:split_at], sleeps gap_s, writes the rest (split_at may also be
    a list of offsets: one write per piece, gap_s apart). Reads `expect` final responses (default: one
    per request method found at the start of request_bytes, i.e. 1)."""
    cuts = sorted({split_at} if isinstance(split_at, int) else set(split_at))
    cuts = [c for c in cuts if 0 < c < len(request_bytes)]
    pieces = [request_bytes[a:b] for a, b in zip([0, *cuts], [*cuts, len(request_bytes)])]
    out = Responses()
    with connect(port, timeout) as s:
        for i, p in enumerate(pieces):
            if i:
                time.sleep(gap_s)
            if not _send(s, p, out):
                return out
        return _read(Reader(s), out, [request_method(request_bytes)] * (expect or 1))


def pipelined(port: int, reqs: list, timeout: float = TIMEOUT) -> Responses:
    """Writes every request in one sendall, then reads len(reqs) final responses (fewer, with .closed
    or .error, if the server answers fewer)."""
    out = Responses()
    with connect(port, timeout) as s:
        if _send(s, b"".join(reqs), out):
            _read(Reader(s), out, [request_method(r) for r in reqs])
    return out


def expect_continue(port: int, path: str, body: bytes, headers: dict | None = None, method: str = "POST",
                    wait_s: float = 1.0, timeout: float = TIMEOUT) -> Responses:
    """Sends the head with Expect: 100-continue and Content-Length, waits up to wait_s for the server's
    first answer (as curl does), sends the body (after a 1xx, or after the wait; not after an early final
    response), then reads the final response. The list's .continue_ tells which: "100" (an interim
    response came first), "timeout" (nothing came within wait_s) or "final" (a final response came
    first: the body was not sent)."""
    hdrs = dict(headers or {})
    hdrs.setdefault("Content-Length", str(len(body)))
    hdrs.setdefault("Expect", "100-continue")
    out = Responses()
    with connect(port, timeout) as s:
        if not _send(s, build_request(method, path, hdrs, None), out):
            return out
        rd = Reader(s)
        s.settimeout(wait_s)
        try:
            rd.first_byte()
            answered = True
        except (socket.timeout, TimeoutError):
            answered = False
        except ConnectionEnded:
            out.closed = True
            return out
        s.settimeout(timeout)
        if answered:
            try:
                first = read_response(rd, method)
            except ConnectionEnded:
                out.closed = True
                return out
            out.append(first)
            if not first.interim:
                out.continue_ = "final"
                out.leftover, out.received = rd.pending(), rd.pos + len(rd.buf)
                return out
            out.continue_ = "100" if first.status == 100 else str(first.status)
        else:
            out.continue_ = "timeout"
        if not _send(s, body, out):
            return out
        return _read(rd, out, [method])


def keepalive(port: int, requests: list, gap_s: float = 0.0, timeout: float = TIMEOUT) -> Responses:
    """Requests in sequence on one connection: each written once the previous response has arrived,
    gap_s after it. Stops early (.closed or .error) if the server closes the connection."""
    out = Responses()
    with connect(port, timeout) as s:
        rd = Reader(s)
        for i, req in enumerate(requests):
            if i:
                if out.closed or out.error or len(out.final) < i:
                    break
                time.sleep(gap_s)
                if rd.eof or (not rd.buf and _closed_now(s)):
                    out.closed = True
                    break
            if not _send(s, req, out):
                break
            _read(rd, out, [request_method(req)])
            if out.final and out.final[-1].headers.get("connection", "").lower() == "close":
                out.closed = _wait_eof(rd, timeout)  # the server said it closes: no further request
                out.leftover, out.received = rd.pending(), rd.pos + len(rd.buf)
                break
    return out


def _wait_eof(rd: Reader, timeout: float) -> bool:
    """Waits (up to timeout) for the server to close; True if it did (bytes before it stay pending)."""
    rd.sock.settimeout(timeout)
    try:
        while True:
            rd._fill()
    except ConnectionEnded:
        return True
    except OSError:
        return False


def chunked_body(port: int, path: str, chunks: list, method: str = "POST", headers: dict | None = None,
                 gap_s: float | None = None, timeout: float = TIMEOUT) -> Responses:
    """A request with a Transfer-Encoding: chunked body of `chunks`. gap_s None: one write; else the head
    and each chunk (the last one included) are separate writes, gap_s apart."""
    if gap_s is None:
        return send_split(port, build_request(method, path, headers, list(chunks), chunked=True), [], 0,
                          timeout=timeout)
    head = build_request(method, path, headers, [], chunked=True)
    head = head[: -len(b"0\r\n\r\n")]
    pieces = [head] + [b"%x\r\n%s\r\n" % (len(c), c) for c in chunks if c] + [b"0\r\n\r\n"]
    data = b"".join(pieces)
    cuts, at = [], 0
    for p in pieces[:-1]:
        at += len(p)
        cuts.append(at)
    return send_split(port, data, cuts, gap_s, timeout=timeout)


def request(port: int, req: bytes, timeout: float = TIMEOUT) -> Responses:
    """One request on a fresh connection."""
    return keepalive(port, [req], timeout=timeout)
