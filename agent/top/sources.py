"""Where the snapshots come from: a running agent's control socket, or an Agent started here.

Both fetch on a background thread and hand out whole Snapshot objects, so the UI thread never calls
BPF or NVML: a slow GPU call or a slow agent can leave the figures old, never the screen frozen.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from ..core.identity import sanitize_text
from ..telemetry.snapshot import Snapshot


class SocketSource:
    """A running agent's snapshots, fetched on a background thread every interval."""

    kind = "socket"

    def __init__(self, path: str, interval_s: float):
        from ..control import ControlClient

        self.client = ControlClient(path)
        self.interval_s = interval_s
        self.snap: Snapshot | None = None
        self.status = f"attaching to {path}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mcp-top-fetch", daemon=True)

    def start(self) -> None:
        self._fetch()
        self._thread.start()

    def _fetch(self) -> None:
        from ..control import ControlError

        try:
            self.snap = self.client.snapshot()
            self.status = ""
        except ControlError as e:
            self.status = f"agent lost: {e} (showing the last snapshot)"

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._fetch()

    def latest(self) -> Snapshot | None:
        return self.snap

    def wait_ready(self, timeout_s: float) -> Snapshot | None:
        return self.snap

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.client.close()


# How long `q` waits for local probes to detach: each uprobe detach waits an RCU-tasks grace period,
# seconds in all for a libcuda's ~40 on a loaded host, and exiting under a detach crashes in bcc.
LOCAL_STOP_S = 30.0


class LocalSource:
    """An Agent started here on a background thread; exporters that only count."""

    kind = "local"

    def __init__(self, cfg):
        self.cfg = cfg
        self.agent = None
        self.status = "starting the probes (compiling BPF)…"
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mcp-top-agent", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _progress(self, text: str) -> None:
        self.status = sanitize_text(text, 200)

    def _run(self) -> None:
        from ..core.agent import StartError
        from ..registry import make_agent
        from ..exporters import counting_only

        try:
            agent = make_agent(self.cfg, exporters=counting_only("none: top counts, exports nothing"),
                          progress=self._progress)
            agent.start()
        except StartError as e:
            self.error = self.status = str(e)
            return
        except Exception as e:  # shown on the screen and returned as the exit status
            self.error = self.status = f"starting the probes failed: {e}"
            return
        self.agent = agent
        self.status = ""
        try:
            agent.run(self._stop)
        finally:
            agent.stop(timeout_s=2.0)

    def latest(self) -> Snapshot | None:
        a = self.agent
        if a is None or getattr(a, "snapshots", None) is None:
            return None
        snap = a.snapshots.latest()
        return snap if snap.seq else None

    def wait_ready(self, timeout_s: float, min_seq: int = 2) -> Snapshot | None:
        """Wait for a snapshot with rates (the second tick), the probes' start, or an error."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.error is None:
            s = self.latest()
            if s is not None and s.seq >= min_seq:
                return s
            time.sleep(0.05)
        return self.latest()

    def stop(self, note: Callable[[str], None] | None = None) -> bool:
        """Stop the agent (drain, detach: seconds with many uprobes on a busy host). False when its
        thread is still at it after LOCAL_STOP_S."""
        self._stop.set()
        if not self._thread.is_alive():
            return True
        self._thread.join(1.0)
        if self._thread.is_alive() and note is not None:
            note("stopping: detaching the probes…")
        self._thread.join(LOCAL_STOP_S - 1.0)
        return not self._thread.is_alive()
