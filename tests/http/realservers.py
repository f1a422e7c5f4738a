"""Real, unmodified third-party HTTP servers for the zero-code HTTP tests and bench scripts (no pytest
needed): Go net/http, Node http, gunicorn (sync and gthread workers) serving a WSGI app, and aiohttp.
Each serves the endpoints of tests/http/servers/ (/fast, /slow?ms=N, /echo, /stream?events=N&gap_ms=M,
/pid) on 127.0.0.1.

    from realservers import start, available
    reason = available("go")            # None, or why it cannot run here (a skip message)
    s = start("gunicorn-sync", workers=2, max_requests=5)
    s.pid, s.port, s.pids()             # the process to watch (gunicorn: the master), its tree
    s.close()

start() returns once the server answers: the port accepts connections and one `GET /pid` got a 200
(for gunicorn, once all workers are forked); pass ready="port" to wait for the port alone (no request).
The readiness request counts toward gunicorn's --max-requests of the worker that served it.

The server runs in a session (and process group) of its own, optionally inside a cgroup v2 directory,
its stdout and stderr kept in a file (Server.log_path, .log_tail(); close() removes it unless
Server.keep_log). The Go server is built once per hash of its sources and the go version into a cache
directory ($MCP_TEST_CACHE, else $XDG_CACHE_HOME/mcp-agent-tests, else /tmp/mcp-agent-tests-UID),
offline (stdlib only, GOPROXY=off, CGO_ENABLED=0: a static binary, no libc).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SERVERS = os.path.join(HERE, "servers")
KINDS = ("go", "node", "gunicorn-sync", "gunicorn-gthread", "aiohttp")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cache_dir() -> str:
    d = os.environ.get("MCP_TEST_CACHE")
    if not d:
        xdg = os.environ.get("XDG_CACHE_HOME")
        d = os.path.join(xdg, "mcp-agent-tests") if xdg else os.path.join(
            tempfile.gettempdir(), f"mcp-agent-tests-{os.getuid()}")
    os.makedirs(d, exist_ok=True)
    return d


# ---------------------------------------------------------------- Go build
_go_built: dict[str, str] = {}


def go_binary() -> str:
    """Builds tests/http/servers/goserver (once per hash of its sources and the go version) and returns
    the binary's path. Raises RuntimeError with go's output if the build fails."""
    go = shutil.which("go")
    if not go:
        raise RuntimeError("go not installed (Debian golang-go; run scripts/setup.sh)")
    src = os.path.join(SERVERS, "goserver")
    version = subprocess.run([go, "version"], capture_output=True, text=True, check=True).stdout
    h = hashlib.sha256(version.encode())
    for name in sorted(os.listdir(src)):
        if name.endswith((".go", ".mod")):
            with open(os.path.join(src, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read() + b"\0")
    key = h.hexdigest()[:16]
    if key in _go_built:
        return _go_built[key]
    base = cache_dir()
    out = os.path.join(base, f"goserver-{key}")
    if not os.access(out, os.X_OK):
        tmp = f"{out}.tmp{os.getpid()}"
        env = dict(os.environ, GOCACHE=os.path.join(base, "gocache"), GOPATH=os.path.join(base, "gopath"),
                   GOENV="off", GOFLAGS="", GOPROXY="off", GO111MODULE="on", GOTOOLCHAIN="local",
                   GOWORK="off", CGO_ENABLED="0")
        r = subprocess.run([go, "build", "-o", tmp, "."], cwd=src, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"go build failed (exit {r.returncode}): {(r.stdout + r.stderr).strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: concurrent builders each rename a complete binary
    _go_built[key] = out
    return out


# ---------------------------------------------------------------- availability
def available(kind: str, python: str | None = None) -> str | None:
    """None if `kind` can run here, else a one-line reason (for a pytest skip message)."""
    if kind not in KINDS:
        return f"unknown server kind {kind!r} (one of {', '.join(KINDS)})"
    if kind == "go":
        try:
            go_binary()
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            return str(e).splitlines()[0] if str(e) else repr(e)
        return None
    if kind == "node":
        return None if shutil.which("node") else "node not installed (Debian nodejs; run scripts/setup.sh)"
    module = "gunicorn" if kind.startswith("gunicorn") else "aiohttp"
    py = python or sys.executable
    if py == sys.executable:
        ok = importlib.util.find_spec(module) is not None
    else:
        ok = subprocess.run([py, "-c", f"import {module}"], capture_output=True).returncode == 0
    return None if ok else f"{module} not importable by {py} (pip install -e .[test]; run scripts/setup.sh)"


# ---------------------------------------------------------------- process tree
def _ppids() -> dict[int, int]:
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                out[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return out


def process_tree(root: int) -> list[int]:
    """root and its descendants now alive (by the PPid links of /proc), root first."""
    ppids = _ppids()
    if root not in ppids:
        return []
    children: dict[int, list[int]] = {}
    for pid, ppid in ppids.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(sorted(children.get(p, ())))
    return out


# ---------------------------------------------------------------- servers
class ServerError(RuntimeError):
    pass


class Server:
    def __init__(self, kind: str, port: int, argv: list[str], cgroup: str | None, env: dict | None,
                 cwd: str, workers: int = 0):
        self.kind, self.port, self.argv, self.cgroup, self.workers = kind, port, argv, cgroup, workers
        self._log = tempfile.NamedTemporaryFile(prefix=f"realserver-{kind}-", suffix=".log", delete=False)
        self.log_path = self._log.name
        self.keep_log = False  # True: close() leaves log_path behind
        cmd = argv
        if cgroup:
            cmd = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', cgroup, *argv]
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=dict(os.environ, **(env or {})), stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid  # sh execs the server: same pid

    def __repr__(self):
        return f"<Server {self.kind} pid={self.pid} port={self.port}>"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def pids(self) -> list[int]:
        """The server's processes now (self.pid first, then its descendants: gunicorn's workers)."""
        return process_tree(self.pid)

    def worker_pids(self) -> list[int]:
        """The direct children of self.pid (gunicorn's workers; empty for the others)."""
        ppids = _ppids()
        return sorted(p for p, pp in ppids.items() if pp == self.pid)

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout: float = 30.0, ready: str = "http") -> None:
        deadline = time.monotonic() + timeout

        def fail(what: str):
            rc = self.proc.poll()
            state = f"exited with {rc}" if rc is not None else "still running"
            tail = self.log_tail()
            self.close()
            raise ServerError(f"{self.kind} server ({' '.join(self.argv)}) {what}; it {state}; "
                              f"its output ends:\n{tail}")

        while True:
            if self.proc.poll() is not None:
                fail("exited before it accepted connections")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    fail(f"did not accept connections on 127.0.0.1:{self.port} within {timeout:.0f} s")
                time.sleep(0.05)
        if ready == "port":
            return
        while self.workers and len(self.worker_pids()) < self.workers:
            if self.proc.poll() is not None:
                fail("exited before its workers started")
            if time.monotonic() > deadline:
                fail(f"did not fork {self.workers} workers within {timeout:.0f} s")
            time.sleep(0.05)
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=5) as c:
                    c.sendall(b"GET /pid HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                    data = b""
                    while b"\r\n\r\n" not in data:
                        got = c.recv(4096)
                        if not got:
                            break
                        data += got
                if data.startswith(b"HTTP/1.1 200"):
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                fail("exited before it answered GET /pid")
            if time.monotonic() > deadline:
                fail(f"did not answer GET /pid with 200 within {timeout:.0f} s")
            time.sleep(0.05)

    def close(self, timeout: float = 10.0) -> None:
        """Kills the server's whole tree (its process group and every descendant) and waits until none
        of it runs (workers orphaned by the master's death are reaped by init, maybe later: zombies
        count as gone)."""
        deadline = time.monotonic() + timeout
        seen: set[int] = set()
        while True:
            pids = self.pids()
            seen.update(pids)
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if self.proc.poll() is None:
                try:
                    self.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            if not running(seen) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        try:
            self._log.close()
            if not self.keep_log:
                os.unlink(self.log_path)
        except OSError:
            pass


def running(pids) -> list[int]:
    """Those of pids that still exist and are not zombies."""
    out = []
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(p)
        except (OSError, IndexError):
            pass
    return out


def command(kind: str, port: int, python: str | None = None, workers: int = 2, threads: int = 4,
            max_requests: int | None = None, max_requests_jitter: int = 0, keepalive: float | None = None,
            timeout: int | None = None, extra_args: tuple = ()) -> list[str]:
    """The command line that serves `kind` on 127.0.0.1:port."""
    py = python or sys.executable
    if kind == "go":
        return [go_binary(), str(port), *extra_args]
    if kind == "node":
        node = shutil.which("node")
        if not node:
            raise ServerError("node not installed")
        return [node, os.path.join(SERVERS, "nodeserver.js"), str(port), *extra_args]
    if kind == "aiohttp":
        return [py, os.path.join(SERVERS, "aiohttp_app.py"), str(port), *extra_args]
    if kind in ("gunicorn-sync", "gunicorn-gthread"):
        argv = [py, "-m", "gunicorn", "--bind", f"127.0.0.1:{port}", "--chdir", SERVERS,
                "--worker-class", kind.split("-", 1)[1], "--workers", str(workers),
                "--log-level", "warning", "--worker-tmp-dir", "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"]
        if kind == "gunicorn-gthread":
            argv += ["--threads", str(threads)]
        if max_requests is not None:
            argv += ["--max-requests", str(max_requests), "--max-requests-jitter", str(max_requests_jitter)]
        if keepalive is not None:
            argv += ["--keep-alive", str(keepalive)]
        if timeout is not None:
            argv += ["--timeout", str(timeout)]
        return [*argv, *extra_args, "wsgi_app:app"]
    raise ValueError(f"unknown server kind {kind!r} (one of {', '.join(KINDS)})")


def start(kind: str, port: int | None = None, cgroup: str | None = None, *, env: dict | None = None,
          ready: str = "http", ready_timeout: float = 30.0, **opts) -> Server:
    """Starts a `kind` server (one of KINDS) on 127.0.0.1:port (a free port if None), inside the cgroup v2
    directory `cgroup` if given, and returns it once it answers (see the module's doc).

    opts (gunicorn only, ignored by the others): workers=2, threads=4 (gthread), max_requests=None,
    max_requests_jitter=0, keepalive=None (gunicorn's --keep-alive seconds; its default is 2),
    timeout=None (--timeout); any kind: python= (for gunicorn/aiohttp), extra_args=()."""
    port = port or free_port()
    argv = command(kind, port, **opts)
    workers = opts.get("workers", 2) if kind.startswith("gunicorn") else 0
    s = Server(kind, port, argv, cgroup, env, cwd=SERVERS, workers=workers)
    s.wait_ready(ready_timeout, ready)
    return s


def served_pid(port: int, timeout: float = 5.0) -> dict:
    """GET /pid on a fresh connection: {"pid": ..., "tid": ...} of the process (thread) that served it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
        c.sendall(b"GET /pid HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        data = b""
        while True:
            got = c.recv(4096)
            if not got:
                break
            data += got
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise ServerError(f"GET /pid answered {head[:80]!r}")
    return json.loads(body)
