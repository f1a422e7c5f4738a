"""Import modules in a thread while the BPF unit compiles.

The OpenTelemetry SDK, protobuf and the exporters (~0.5 s of a GPU host's start under the compile's
load) are first used after the probes are attached (Agent.start); pynvml by NVML's warm-up thread,
which otherwise imports it while the load is being finished. `mcp-agent run` starts their import
here, once its own import of the pipeline (which the attach needs) is done: begun before it, the two
shared the GIL and the pipeline's took twice as long where the compile is short (a start from the
compile cache). They overlap the compile, or the load and attach, which spend their time in syscalls.
Agent.start waits for them before importing them itself (pynvml, a leaf, may be imported by both: its
module lock makes one thread wait for the other).

pyroute2 (the NIC watch's, after the attach) is begun only once the probes are attached (after_load):
begun with the others, its import runs beside the end of a first start's load (programs loaded and
cache entries written, all Python), and the two share the GIL.
"""

from __future__ import annotations

import importlib
import threading

_thread: threading.Thread | None = None
_after: threading.Thread | None = None  # after_load's


def _begin(name: str, modules: tuple[str, ...]) -> threading.Thread | None:
    """The modules imported in order in a thread; None where none can start (TasksMax), and their
    users import them, as without this module. A module that fails to import ends the thread: its
    user's own import reports it."""

    def run():
        for m in modules:
            try:
                importlib.import_module(m)
            except BaseException:  # noqa: BLE001 - reported by the import that follows
                return

    t = threading.Thread(target=run, name=name, daemon=True)
    try:
        t.start()
    except RuntimeError:
        return None
    return t


def start(*modules: str) -> None:
    """Joined by wait(); Agent.start imports them after it."""
    global _thread
    _thread = _begin("mcp-import-behind", modules)


def after_load(*modules: str) -> None:
    """Joined by wait_after_load()."""
    global _after
    _after = _begin("mcp-import-after-load", modules) if modules else None


def wait_after_load() -> None:
    """Before its user starts (the NIC watch, whose 5 s to come up must not include the import), and
    before a failed start's error line."""
    if _after is not None:
        _after.join()


def wait() -> None:
    """Also before a failed start exits: an import's warning must not follow the error line."""
    if _thread is not None:
        _thread.join()
