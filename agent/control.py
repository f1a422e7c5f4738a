"""The running agent's local control socket: snapshots for `mcp-agent top` and scripts.

A Unix stream socket (setting control.socket: default /run/mcp-hostagent/agent.sock), mode
0660: root and the socket's group (setting control.group; unset: root's) may connect; there is no
TCP listener. Requests and answers are newline-delimited JSON, one answer line per request line, on
a connection the client may keep:

    {"op": "ping"}      -> {"ok": true, "pid": ..., "version": ...}
    {"op": "snapshot"}  -> the latest snapshot.Snapshot as JSON (a bare `snapshot` line works too)

The server only reads SnapshotBuilder.latest_json(): serving a client never touches BPF, NVML or the
agent's thread. Clients are bounded (count, count per uid, request size, idle time, and a total
time per connection), so a stuck or hostile one costs one thread until its deadline and nothing
else; each refusal is counted (`rejected`, the agent's hostagent.agent.records.rejected, reasons control_*).
ControlClient reconnects when the agent ends a connection, so the deadline costs `top` nothing.
"""

from __future__ import annotations

import grp
import json
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections import Counter

from . import __version__
from .telemetry.snapshot import Snapshot

log = logging.getLogger("mcp_hostagent")

DEFAULT_SOCKET = "/run/mcp-hostagent/agent.sock"  # the control.socket setting's default
MAX_REQUEST = 4096
MAX_ANSWER = 64 << 20
MAX_CLIENTS = 16
MAX_CLIENTS_PER_UID = 4  # one uid (one user in control.group) cannot take every slot
CONNECTION_DEADLINE_S = 60.0  # a connection's whole life: a trickling client cannot hold a slot longer


class ControlError(RuntimeError):
    """One line, with a hint where there is one."""


def _connect(path: str, timeout_s: float) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        s.connect(path)
    except FileNotFoundError:
        s.close()
        raise ControlError(f"no agent socket at {path} (is `mcp-agent run` running?)") from None
    except PermissionError:
        s.close()
        raise ControlError(f"permission denied on {path}; HINT: run as root or as a member of its group") from None
    except ConnectionRefusedError:
        s.close()
        raise ControlError(f"nothing listens on {path} (a stale socket: the agent is not running)") from None
    except OSError as e:
        s.close()
        raise ControlError(f"connect {path}: {e.strerror or e}") from None
    return s


def resolve_group(group: str | int | None) -> int | None:
    """control.group -> gid (None: leave the socket's group alone). ControlError for an unknown name:
    config.py checked it at load, but /etc/group may have changed since (SIGHUP reloads re-check)."""
    if group is None or group == "":
        return None
    if isinstance(group, int):
        return group
    if group.isascii() and group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ControlError(f"control.group {group!r}: no such group") from None


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


class ControlServer:
    def __init__(self, builder, path: str | None = None, mode: int = 0o660, max_clients: int = MAX_CLIENTS,
                 idle_timeout_s: float = 30.0, group: str | int | None = None,
                 max_per_uid: int = MAX_CLIENTS_PER_UID, deadline_s: float = CONNECTION_DEADLINE_S,
                 rejected: Counter | None = None):
        self.builder = builder
        self.path = path or DEFAULT_SOCKET
        self.mode = mode
        self.group = group
        self.gid: int | None = None  # the socket's group once started
        self.group_error: str | None = None  # control.group could not be applied: why, with a hint
        self.idle_timeout_s = idle_timeout_s
        self._slots = threading.BoundedSemaphore(max_clients)
        self.max_per_uid = max_per_uid
        self.deadline_s = deadline_s
        self._per_uid: Counter = Counter()  # uid -> connections being served
        self._lock = threading.Lock()
        # refusals by reason; the agent passes AgentHealth.rejected, which it exports
        self.rejected: Counter = Counter() if rejected is None else rejected
        self._sock: socket.socket | None = None
        self._ino: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.served = 0

    def start(self) -> None:
        """Bind and serve on a thread. Raises ControlError when another agent already answers there.
        A control.group that cannot be given (no CAP_CHOWN, not a member) leaves the socket root's
        group, reachable by root only, and says why in group_error."""
        want_gid = resolve_group(self.group)
        d = os.path.dirname(self.path) or "."
        os.makedirs(d, mode=0o755, exist_ok=True)
        if os.path.lexists(self.path):
            st = os.lstat(self.path)
            if not stat.S_ISSOCK(st.st_mode):
                raise ControlError(f"{self.path} exists and is not a socket; not replacing it")
            try:
                _connect(self.path, 0.5).close()
            except ControlError:
                pass  # stale: replaced by the rename below
            else:
                raise ControlError(f"another agent already serves {self.path}")
        # Bind under a temporary name, set the mode and group, then rename over the final name: the
        # socket is never reachable with the umask's mode or by another group, and os.umask
        # (process-wide) is left alone.
        tmp = f"{self.path}.{os.getpid()}.tmp"
        if os.path.lexists(tmp):
            os.unlink(tmp)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(tmp)
            os.chmod(tmp, self.mode)
            if want_gid is not None:
                try:
                    os.chown(tmp, -1, want_gid)
                except PermissionError:
                    self.group_error = (f"not given to group {group_name(want_gid)}: chown: Operation not "
                                        "permitted; HINT: the agent needs CAP_CHOWN or membership of that group "
                                        "(systemd: SupplementaryGroups=)")
            self.gid = os.stat(tmp).st_gid
            os.rename(tmp, self.path)
            s.listen(16)
        except OSError as e:
            s.close()
            if os.path.lexists(tmp):
                os.unlink(tmp)
            raise ControlError(f"control socket {self.path}: {e.strerror or e}") from None
        s.settimeout(0.5)  # accept() wakes to see stop()
        self._ino = os.stat(self.path).st_ino
        self._sock = s
        self._thread = threading.Thread(target=self._accept_loop, name="mcp-control", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._sock is not None:
            # a connection of our own wakes accept(), so stopping does not wait out its timeout (0.5 s
            # of every stop); shutdown() of a listening AF_UNIX socket does not wake a poller
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as w:
                    w.settimeout(0.2)
                    w.connect(self.path)  # (bound under a temporary name, then renamed: not getsockname())
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        try:  # only our own socket: another agent may have replaced it since
            if self._ino is not None and os.stat(self.path).st_ino == self._ino:
                os.unlink(self.path)
        except OSError:
            pass

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            if self._stop.is_set():
                conn.close()
                return
            try:
                uid = peer_uid(conn)
            except OSError:
                conn.close()
                continue
            with self._lock:
                over_uid = self._per_uid[uid] >= self.max_per_uid
                if not over_uid:
                    self._per_uid[uid] += 1
            if over_uid:
                self._refuse(conn, "control_uid_limit", b'{"error":"too many clients of this uid"}\n')
                continue
            if not self._slots.acquire(blocking=False):
                self._release_uid(uid)
                self._refuse(conn, "control_too_many_clients", b'{"error":"too many clients"}\n')
                continue
            threading.Thread(target=self._serve, args=(conn, uid), name="mcp-control-client", daemon=True).start()

    def count(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] += 1

    def _refuse(self, conn: socket.socket, reason: str, line: bytes) -> None:
        self.count(reason)
        try:  # never blocks the accept loop: a fresh socket's buffer takes one line
            conn.setblocking(False)
            conn.send(line)
        except OSError:
            pass
        finally:
            conn.close()

    def _release_uid(self, uid: int) -> None:
        with self._lock:
            self._per_uid[uid] -= 1
            if self._per_uid[uid] <= 0:
                del self._per_uid[uid]

    def _serve(self, conn: socket.socket, uid: int) -> None:
        # Each blocking call gets the time left to the connection's deadline (at most the idle
        # timeout): a per-call timeout alone lets a client that sends a byte a second stay forever.
        deadline = time.monotonic() + self.deadline_s

        def budget() -> float:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            return min(left, self.idle_timeout_s)

        try:
            buf = b""
            while not self._stop.is_set():
                while b"\n" not in buf:
                    if len(buf) > MAX_REQUEST:
                        self.count("control_request_too_long")
                        conn.settimeout(budget())
                        conn.sendall(b'{"error":"request too long"}\n')
                        return
                    conn.settimeout(budget())
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    buf += chunk
                line, buf = buf.split(b"\n", 1)
                answer = self.answer(line)
                conn.settimeout(budget())
                conn.sendall(answer)  # (a whole sendall is bounded by the timeout: Python >= 3.5)
        except TimeoutError:
            if time.monotonic() >= deadline:
                self.count("control_deadline")
            else:
                self.count("control_idle")
        except OSError:  # reset, broken pipe: the client's problem, not the agent's
            pass
        finally:
            conn.close()
            self._release_uid(uid)
            self._slots.release()

    def answer(self, line: bytes) -> bytes:
        text = line.strip()
        op = None
        if text.startswith(b"{"):
            try:
                req = json.loads(text)
                op = req.get("op") if isinstance(req, dict) else None
            except ValueError:
                return b'{"error":"bad JSON"}\n'
            except RecursionError:  # [[[[...]]]] deeper than the interpreter's recursion limit
                self.count("control_nested_json")
                return b'{"error":"JSON nested too deep"}\n'
        elif text:
            op = text.decode("ascii", "replace")
        if op == "snapshot":
            self.served += 1
            return self.builder.latest_json()
        if op == "ping":
            return json.dumps({"ok": True, "pid": os.getpid(), "version": __version__}).encode() + b"\n"
        return json.dumps({"error": "unknown op", "ops": ["ping", "snapshot"]}).encode() + b"\n"


class ControlClient:
    """One connection, reused for every request; reconnects once when the agent restarted."""

    def __init__(self, path: str | None = None, timeout_s: float = 2.0):
        self.path = path or DEFAULT_SOCKET
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._buf = b""

    def request(self, op: str) -> dict:
        for attempt in (0, 1):
            if self._sock is None:
                self._sock = _connect(self.path, self.timeout_s)
                self._buf = b""
            try:
                self._sock.sendall(json.dumps({"op": op}).encode() + b"\n")
                line = self._readline()
            except (OSError, ControlError) as e:
                self.close()
                if attempt:
                    raise ControlError(f"{self.path}: {getattr(e, 'strerror', None) or e}") from None
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                raise ControlError(f"{self.path}: not a JSON answer") from None
            if isinstance(obj, dict) and "error" in obj and len(obj) <= 2:
                raise ControlError(f"{self.path}: agent says: {obj['error']}")
            return obj
        raise AssertionError("unreachable")

    def _readline(self) -> bytes:
        while b"\n" not in self._buf:
            if len(self._buf) > MAX_ANSWER:
                raise ControlError("answer too long")
            chunk = self._sock.recv(1 << 16)
            if not chunk:
                raise ControlError("connection closed by the agent")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def ping(self) -> dict:
        return self.request("ping")

    def snapshot(self) -> Snapshot:
        return Snapshot.from_dict(self.request("snapshot")).with_source("socket")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def fetch_snapshot(path: str | None = None, timeout_s: float = 2.0) -> Snapshot:
    """The running agent's latest snapshot (source "socket"); ControlError when none answers."""
    c = ControlClient(path, timeout_s)
    try:
        return c.snapshot()
    finally:
        c.close()


def agent_answers(path: str | None = None, timeout_s: float = 1.0) -> bool:
    c = ControlClient(path, timeout_s)
    try:
        return bool(c.ping().get("ok"))
    except ControlError:
        return False
    finally:
        c.close()


def peer_uid(conn: socket.socket) -> int:
    """The connecting process's uid, from the kernel (SO_PEERCRED), not from anything it says."""
    _pid, uid, _gid = struct.unpack("iII", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII")))
    return uid


def serve(builder, echo, path: str, group: str | None = None, rejected: Counter | None = None) -> ControlServer | None:
    """Start serving for `mcp-agent run`: one line on what happened; a failure costs the socket only."""
    if not path:
        echo('  control:  off (control.socket = "")')
        return None
    srv = ControlServer(builder, path, group=group, rejected=rejected)
    try:
        srv.start()
    except (ControlError, OSError) as e:
        echo(f"  control:  not served: {e}")
        return None
    owner = f"group {group_name(srv.gid)}"
    if srv.group_error:
        owner += f", {srv.group_error}"
    echo(f"  control:  {srv.path} (mode {srv.mode:04o}, {owner}; `mcp-agent top` attaches here)")
    return srv
