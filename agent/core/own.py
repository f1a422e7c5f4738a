"""The agent's own processes: this one and its compile workers not yet reaped. The watch set never
holds them (core/discovery.py); the loader says which workers it started (core/loader.py). A module of
its own so that neither imports the other."""

from __future__ import annotations

import os
import subprocess
import threading

_lock = threading.Lock()
_live: dict[int, subprocess.Popen] = {}  # pid -> compile worker, until reaped


def started(proc: subprocess.Popen) -> None:
    with _lock:
        _live[proc.pid] = proc


def pids() -> set[int]:
    """This process and its compile workers not yet reaped."""
    with _lock:
        for pid in [pid for pid, p in _live.items() if p.returncode is not None]:
            del _live[pid]
        return {os.getpid(), *_live}
