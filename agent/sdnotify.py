"""sd_notify(3) without libsystemd: readiness, watchdog pings, status and stopping for systemd.

systemd passes $NOTIFY_SOCKET (a path, or "@name" for the abstract namespace) to a Type=notify
service; each message is one datagram of newline-separated KEY=VALUE lines. $WATCHDOG_USEC (and
$WATCHDOG_PID, when set, naming the process that must ping) say whether WATCHDOG=1 is expected.
Without $NOTIFY_SOCKET every call is a no-op, so `mcp-agent run` in a terminal is unaffected.
A send that fails (systemd gone, socket full) is ignored: notification must never stop the agent.
"""

from __future__ import annotations

import os
import socket
import time


class Notifier:
    def __init__(self, env=None):
        env = os.environ if env is None else env
        self.address = _address(env.get("NOTIFY_SOCKET", ""))
        self.watchdog_usec = _watchdog_usec(env)
        self._sock: socket.socket | None = None
        self._last_status: str | None = None
        self.sent = 0

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog(self) -> bool:
        return self.enabled and self.watchdog_usec > 0

    def notify(self, *lines: str) -> bool:
        """Send one datagram of `lines`; True if it went out."""
        if self.address is None:
            return False
        msg = "\n".join(line.replace("\n", " ") for line in lines).encode("utf-8", "replace")
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(msg, self.address)
        except OSError:
            return False
        self.sent += 1
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def reloading(self) -> bool:
        # MONOTONIC_USEC lets Type=notify-reload (systemd >= 253) match this to its reload job
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        """STATUS=text, sent only when it changed."""
        if text == self._last_status:
            return False
        self._last_status = text
        return self.notify(f"STATUS={text}")

    def ping(self) -> bool:
        """WATCHDOG=1 when systemd asked for it (WatchdogSec=); a no-op otherwise."""
        return self.watchdog and self.notify("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _address(value: str):
    if not value or not (value.startswith("/") or value.startswith("@")):
        return None  # unset, or a vsock address (not for us)
    if value.startswith("@"):
        return "\0" + value[1:]  # abstract namespace (Python takes a leading NUL for it)
    return value


def _watchdog_usec(env) -> int:
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
    except ValueError:
        return 0
    pid = env.get("WATCHDOG_PID")
    if pid is not None and pid.strip() and pid.strip() != str(os.getpid()):
        return 0  # meant for another process (e.g. a wrapper that exec'd us would have the same pid)
    return max(usec, 0)
