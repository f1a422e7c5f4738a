"""`mcp-agent top`: a live terminal view of the host, its processes and the newest findings.

main() picks the source (a running agent's control socket when one answers, else the probes started
here), then runs the curses screen, a plain stream of frames, or one frame / one JSON snapshot.

  text.py     cell widths, sanitised and fitted text, number formats
  layout.py   the columns, what fits a width, the view state, row order
  render.py   a Snapshot into lines of styled segments (pure), and those as printable text
  keys.py     key presses -> view state, and the help that lists them
  sources.py  SocketSource and LocalSource: snapshots fetched on background threads
  screen.py   the curses loop and the plain stream loop
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from typing import Callable

from .layout import ViewState
from .render import frame_text, render
from .screen import _LogTail, _term_width, colour_allowed, run_curses, run_stream
from .sources import LOCAL_STOP_S, LocalSource, SocketSource


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(*, cfg_loader: Callable[[], object], socket_path: str | None, local: bool, interval_s: float,
         once: bool, as_json: bool, stream=None) -> int:
    """The `top` command. Returns the exit status; errors are one line on stderr."""
    from .. import control

    stream = stream or sys.stdout
    explicit = socket_path is not None
    cfg = cfg_loader()
    path = socket_path or cfg.control_socket
    source, why = None, "control.socket is off"
    if not local and path:
        client = control.ControlClient(path, 1.0)
        try:
            client.ping()
            source = SocketSource(path, interval_s)
        except control.ControlError as e:
            why = str(e)
        finally:
            client.close()
        if source is None and explicit:
            sys.stderr.write(f"mcp-agent: error: {why}\n")
            return 1
    if source is None:
        if os.geteuid() != 0:
            sys.stderr.write(f"mcp-agent: error: {why}; starting the probes here needs root; "
                             "HINT: sudo mcp-agent top, or start `mcp-agent run`\n")
            return 1
        source = LocalSource(cfg)
    st = ViewState()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)  # restore the terminal and stop the probes on kill
    tail = None
    saved_fd = None
    interactive = not (once or as_json) and stream.isatty() and sys.stdin.isatty()
    if interactive and source.kind == "local":
        # bcc's compiler writes warnings straight to fd 2, and the agent logs: neither may scribble
        # over the screen. Restored before anything is reported.
        tail = _LogTail()
        root = logging.getLogger()
        saved_handlers, root.handlers = root.handlers, [tail]
        saved_fd = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
    rc, err, stopped = 0, None, True
    try:
        source.start()
        if once or as_json:
            snap = source.wait_ready(30.0 + 3 * interval_s) if source.kind == "local" else source.latest()
            if snap is None:
                err = f"no snapshot: {getattr(source, 'error', None) or source.status}"
            elif as_json:
                stream.write(json.dumps(snap.to_dict(), separators=(",", ":")) + "\n")
            else:
                stream.write(frame_text(render(snap, _term_width(stream), None, st), colour_allowed(stream), stream))
            stream.flush()
        elif interactive:
            run_curses(source, interval_s, st)
            err = getattr(source, "error", None)
        else:
            if source.kind == "local":
                source.wait_ready(30.0 + 3 * interval_s, min_seq=1)
            run_stream(source, interval_s, st, stream)
    except KeyboardInterrupt:
        pass
    finally:
        def note(text: str) -> None:  # the terminal, while fd 2 still hides bcc's detach noise
            os.write(saved_fd, f"mcp-agent: {text}\n".encode())

        if source.kind == "local":
            stopped = source.stop(note if saved_fd is not None else None)
        else:
            source.stop()
        if saved_fd is not None:
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            logging.getLogger().handlers = saved_handlers
    if err:
        sys.stderr.write(f"mcp-agent: error: {err}\n")
        rc = 1
    if not stopped:
        # The agent's thread is still detaching: interpreter shutdown would run bcc's atexit cleanup
        # on the same objects under it (double closes, a crash). The kernel detaches what a process
        # held when it exits.
        sys.stderr.write(f"mcp-agent: warning: the probes did not detach within {LOCAL_STOP_S:.0f} s; "
                         "exiting without waiting\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc
