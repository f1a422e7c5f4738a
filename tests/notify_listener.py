"""What systemd does for a Type=notify service, for tests: an AF_UNIX datagram socket (a path, or
"@name" in the abstract namespace) that keeps every sd_notify message with its arrival time."""

from __future__ import annotations

import socket
import threading
import time


class NotifySocket:
    """What systemd listens on: an AF_UNIX datagram socket; every datagram kept with its arrival time."""

    def __init__(self, address: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.settimeout(0.1)
        self.address = address
        self.messages: list[tuple[float, dict[str, str]]] = []
        self.hooks = []  # called on each message, in the reader thread, as it arrives
        self._stop = False
        self._cond = threading.Condition()
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self):
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return
            fields = dict(ln.split("=", 1) for ln in data.decode().split("\n") if "=" in ln)
            for hook in self.hooks:
                hook(fields)
            with self._cond:
                self.messages.append((time.monotonic(), fields))
                self._cond.notify_all()

    def wait(self, key: str, value: str | None = None, timeout: float = 30.0, after: int = 0) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for _, f in self.messages[after:]:
                    if key in f and (value is None or f[key] == value):
                        return f
                left = deadline - time.monotonic()
                assert left > 0, f"no {key}={value} in {self.messages}"
                self._cond.wait(left)

    def keys(self) -> list[str]:
        with self._cond:
            return [k for _, f in self.messages for k in f]

    def close(self):
        self._stop = True
        self._t.join(1)
        self.sock.close()
